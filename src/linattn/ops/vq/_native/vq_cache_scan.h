// The cache of Transformer-VQ's block form at the start of every segment of a row, for the
// native block form and its gradients (vq_block_forward.cpp, vq_block_backward.cpp), which
// compute a row's segments (runs of `segment_blocks` blocks) as separate tasks.
//
// The cache before block r holds, per code s, the count n_s and the sum u_s of the values of
// every position in blocks <= r - 2 quantized to s (block r - 1 enters it after block r; block
// 0's previous block is the carried one, when there is one). The scan adds the positions one by
// one in order, as the sequential walk does, so the sums are the same bits.
#pragma once

#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace linattn_native {

// A block entering the cache: for its L positions j in order, n_{z_j} += 1 and u_{z_j} += v_j
// (codes [L], values [L, Dv]).
template <typename T>
inline void enter_block(const int64_t* codes, const T* values, int64_t L, int64_t Dv, T* counts, T* sums) {
  for (int64_t j = 0; j < L; ++j) {
    const int64_t z = codes[j];
    counts[z] += 1;
    T* u = sums + z * Dv;
    const T* value = values + j * Dv;
    for (int64_t e = 0; e < Dv; ++e) u[e] += value[e];
  }
}

// counts [B Hkv, S] and sums [B Hkv, S, Dv]: the cache before block 0. segment_counts
// [B Hkv, segments, S] and segment_sums [B Hkv, segments, S, Dv] get the cache before the first
// block of every segment, final_counts / final_sums (same shapes as counts / sums) the one before
// block full_blocks. prev_codes [B Hkv, R, L]: block r's previous block's codes; v [B Hkv, R, L,
// Dv] the values, first_v [B Hkv, L, Dv] block 0's previous values.
template <typename T>
void scan_caches(int64_t rows, int64_t R, int64_t L, int64_t S, int64_t Dv, int64_t segment_blocks, bool has_prev,
                 int64_t full_blocks, const int64_t* prev_codes, const T* v, const T* first_v, const T* counts,
                 const T* sums, T* segment_counts, T* segment_sums, T* final_counts, T* final_sums) {
  const int64_t segments = (R + segment_blocks - 1) / segment_blocks;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> run_counts(S), run_sums(S * Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      std::memcpy(run_counts.data(), counts + bh * S, S * sizeof(T));
      std::memcpy(run_sums.data(), sums + bh * S * Dv, S * Dv * sizeof(T));
      for (int64_t r = 0; r <= R; ++r) {
        if (r == full_blocks) {
          std::memcpy(final_counts + bh * S, run_counts.data(), S * sizeof(T));
          std::memcpy(final_sums + bh * S * Dv, run_sums.data(), S * Dv * sizeof(T));
        }
        if (r == R) break;
        if (r % segment_blocks == 0) {
          const int64_t segment = bh * segments + r / segment_blocks;
          std::memcpy(segment_counts + segment * S, run_counts.data(), S * sizeof(T));
          std::memcpy(segment_sums + segment * S * Dv, run_sums.data(), S * Dv * sizeof(T));
        }
        if (r == 0 && !has_prev) continue;
        const T* values = r > 0 ? v + (bh * R + r - 1) * L * Dv : first_v + bh * L * Dv;
        enter_block(prev_codes + (bh * R + r) * L, values, L, Dv, run_counts.data(), run_sums.data());
      }
    }
  });
}

}  // namespace linattn_native
