// Transformer-VQ's causal block form for hard codes, fused per block.
//
// The same computation as ops/vq/running.py (running_blocks) for CPU tensors in float32 or
// float64. A (batch, kv head) row is cut into segments of segment_blocks blocks; the cache at
// each segment's start comes from a scan over the row's codes and values (vq_cache_scan.h, the
// same additions in the same order as the walk below), and every (row, segment) is one task of
// at::parallel_for, computed by one thread (the segments are fixed by segment_blocks, not by the
// thread count, so results do not depend on it; a single sequence with one kv head still keeps
// every thread busy). Per segment, blocks in order, with the cache (counts n_s, sums u_s)
// carried from block to block, for queries q not yet scaled:
//
//   x       = scale Q_r [K_{r-1}; K_r]^T + bias + scale band   [L, 2L]   (the window)
//   y       = scale Q_r C^T + log n                              [L, S]    (the cache; C the codebook)
//   out_r   = softmax([x | y]) [V_{r-1}; V_r; u / n]             [L, Dv]
//
// computed per block as: the scores Q_r [K_{r-1}; K_r; C]^T by one product (the codebook lives in
// the keys buffer's last S rows); one pass per row adds the bias, the band and log n, takes the
// row's maximum and writes exp(x - top) and exp(scale q.c_s - top)
// (= exp(y_s - top) / n_s; an empty slot, n_s = 0, gets -inf before the exp, so 0 however high
// its score) with the row's total; one product with the values
// [V_{r-1}; V_r; u] (u, the cache's sums, live in that buffer and are updated in place) and the
// output rows divided by their totals. Then block r - 1 enters the cache: n_{z_j} += 1,
// u_{z_j} += v_j for its positions j.
//
// band: q_a . P_delta at offset delta = L + a - c of query row a and window column c, for
// 0 <= delta <= L (one product Q_r P^T [L, L + 1] per block and query group), when position
// keys P are given. Block 0's previous block is the carried one (has_prev) or none (its
// columns get -inf). The cache before block full_blocks is the call's final cache. The float32
// exp is vectorisable (range reduction and a degree-6 polynomial, relative error below 2e-7);
// float64 uses std::exp. With lse, every row's log-sum-exp log(sum_c exp(score_c)) (the cache's
// columns counted n_s times) is kept for the backward (vq_block_backward.cpp).
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include "fast_exp.h"
#include "vq_block_inputs.h"
#include "vq_cache_scan.h"
#include "vq_kernels.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using linattn_native::check_tensor;
using linattn_native::exp_of;



// One softmax per score row of a block over [window (2L) | cache (S)] columns, in place, for
// scores q.k not yet scaled: the window's scale q.k + bias (the bias has -inf above the
// diagonal) + scale band (band [L, L + 1], q_a . P_delta, or null), the cache's
// scale q.c_s + log n_s. What is stored: exp(x - top) on the window, and on the cache
// exp(scale q.c_s - top) = exp(x_s - top) / n_s (0 where n_s = 0), so that the product with
// [window values; cache sums] is the output times the row's total; totals[a] gets 1 / total.
template <typename T>
void block_softmax(T* scores, int64_t L, int64_t S, T scale, const T* bias, const T* band, bool without_prev,
                   const T* counts, const T* log_counts, T* totals, T* lse) {
  const int64_t W = 2 * L, C = W + S;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  for (int64_t a = 0; a < L; ++a) {
    T* row = scores + a * C;
    const T* bias_row = bias + a * W;
    const int64_t first = without_prev ? L : 0;  // block 0 without a previous block: its columns get -inf
    for (int64_t c = 0; c < first; ++c) row[c] = minus_inf;
    T top = minus_inf;
#pragma omp simd reduction(max : top)
    for (int64_t c = first; c < W; ++c) {
      row[c] = scale * row[c] + bias_row[c];
      top = row[c] > top ? row[c] : top;
    }
    if (band != nullptr) {  // columns c = a .. a + L: delta = L + a - c runs L .. 0
      const T* band_row = band + a * (L + 1) + L + a;
      top = minus_inf;
      for (int64_t c = first > a ? first : a; c <= a + L; ++c) row[c] += scale * band_row[-c];
#pragma omp simd reduction(max : top)
      for (int64_t c = first; c < W; ++c) top = row[c] > top ? row[c] : top;
    }
    T* cache = row + W;
#pragma omp simd reduction(max : top)
    for (int64_t s = 0; s < S; ++s) {
      const T x = scale * cache[s];
      cache[s] = log_counts[s] == minus_inf ? minus_inf : x;  // an empty slot: weight 0, however high x
      const T y = x + log_counts[s];
      top = y > top ? y : top;
    }
    T total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < W; ++c) {
      const T e = exp_of(row[c] - top);
      row[c] = e;
      total += e;
    }
#pragma omp simd reduction(+ : total)
    for (int64_t s = 0; s < S; ++s) {
      const T e = exp_of(cache[s] - top);
      cache[s] = e;
      total += e * counts[s];
    }
    totals[a] = T(1) / total;
    if (lse != nullptr) lse[a] = top + std::log(total);
  }
}

template <typename T>
void block_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                const at::Tensor& codebook, const at::Tensor& window,
                const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k, const at::Tensor& first_v,
                bool has_prev, const at::Tensor& counts, const at::Tensor& sums, int64_t full_blocks, double scale,
                at::Tensor& out, at::Tensor& final_counts, at::Tensor& final_sums,
                const c10::optional<at::Tensor>& lse, int64_t segment_blocks) {
  const auto dtype = q.scalar_type();
  const auto n = linattn_native::check_block_inputs("vq block form (native)", q, k, v, prev_codes, codebook, window,
                                                    position_keys, first_k, first_v, counts, sums, out);
  const int64_t B = n.B, Hkv = n.Hkv, G = n.G, R = n.R, L = n.L, Dk = n.Dk, S = n.S, Dv = n.Dv;
  const int64_t W = 2 * L, C = W + S, Wh = n.Wh, Wg = n.Wg, Ph = n.Ph, Pg = n.Pg;
  TORCH_CHECK(full_blocks >= 0 && full_blocks <= R, "vq block form (native): full_blocks ", full_blocks,
              " outside [0, ", R, "]");
  TORCH_CHECK(segment_blocks >= 1, "vq block form (native): segment_blocks ", segment_blocks, " < 1");
  check_tensor("vq block form (native)", final_counts, "final_counts", dtype, {B, Hkv, S});
  check_tensor("vq block form (native)", final_sums, "final_sums", dtype, {B, Hkv, S, Dv});
  if (lse.has_value()) check_tensor("vq block form (native)", *lse, "lse", dtype, {B, Hkv, G, R, L});
  const int64_t* code_data = prev_codes.data_ptr<int64_t>();
  const auto options = q.options();

  // the cache at every segment's start (and the final one) first; then every (row, segment) is a task
  const int64_t segments = (R + segment_blocks - 1) / segment_blocks;
  at::Tensor segment_counts = at::empty({B * Hkv, segments, S}, options);
  at::Tensor segment_sums = at::empty({B * Hkv, segments, S, Dv}, options);
  linattn_native::scan_caches<T>(B * Hkv, R, L, S, Dv, segment_blocks, has_prev, full_blocks, code_data,
                                 v.data_ptr<T>(), first_v.data_ptr<T>(), counts.data_ptr<T>(), sums.data_ptr<T>(),
                                 segment_counts.data_ptr<T>(), segment_sums.data_ptr<T>(),
                                 final_counts.data_ptr<T>(), final_sums.data_ptr<T>());

  at::parallel_for(0, B * Hkv * segments, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scores = at::empty({L, C}, options), band = at::empty({L, L + 1}, options);
    at::Tensor keys = at::empty({C, Dk}, options), values = at::empty({C, Dv}, options);
    std::vector<T> row_counts(S), log_counts(S), totals(L);
    T* key_data = keys.data_ptr<T>();
    T* value_data = values.data_ptr<T>();
    T* cache_sums = value_data + W * Dv;  // the cache's sums live in the values' last S rows
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / segments, segment = task % segments;
      const int64_t b = bh / Hkv, h = bh % Hkv;
      const int64_t first_block = segment * segment_blocks;
      const int64_t last_block = std::min(R, first_block + segment_blocks);
      std::memcpy(key_data + W * Dk, codebook.data_ptr<T>() + h * S * Dk, S * Dk * sizeof(T));  // the keys' last S rows
      std::memcpy(row_counts.data(), segment_counts.data_ptr<T>() + task * S, S * sizeof(T));
      std::memcpy(cache_sums, segment_sums.data_ptr<T>() + task * S * Dv, S * Dv * sizeof(T));
      const T* k_row = k.data_ptr<T>() + bh * R * L * Dk;
      const T* v_row = v.data_ptr<T>() + bh * R * L * Dv;
      const int64_t* codes_row = code_data + bh * R * L;
      std::vector<at::Tensor> q_rows, out_rows, position_rows;  // per query group: [R L, Dk], [R L, Dv], P^T
      for (int64_t g = 0; g < G; ++g) {
        q_rows.push_back(q[b][h][g].view({R * L, Dk}));
        out_rows.push_back(out[b][h][g].view({R * L, Dv}));
        if (position_keys.has_value()) position_rows.push_back((*position_keys)[Ph == 1 ? 0 : h][Pg == 1 ? 0 : g].t());
      }
      for (int64_t r = first_block; r < last_block; ++r) {
        const T* prev_k = r > 0 ? k_row + (r - 1) * L * Dk : first_k.data_ptr<T>() + bh * L * Dk;
        const T* prev_v = r > 0 ? v_row + (r - 1) * L * Dv : first_v.data_ptr<T>() + bh * L * Dv;
        std::memcpy(key_data, prev_k, L * Dk * sizeof(T));
        std::memcpy(key_data + L * Dk, k_row + r * L * Dk, L * Dk * sizeof(T));
        std::memcpy(value_data, prev_v, L * Dv * sizeof(T));
        std::memcpy(value_data + L * Dv, v_row + r * L * Dv, L * Dv * sizeof(T));
        for (int64_t s = 0; s < S; ++s) {
          const T n = row_counts[s];
          log_counts[s] = n == 0 ? -std::numeric_limits<T>::infinity() : std::log(n);
        }
        const bool without_prev = r == 0 && !has_prev;
        for (int64_t g = 0; g < G; ++g) {
          const at::Tensor q_block = q_rows[g].narrow(0, r * L, L);
          at::mm_out(scores, q_block, keys.t());
          const T* bias = window.data_ptr<T>() + ((Wh == 1 ? 0 : h) * Wg + (Wg == 1 ? 0 : g)) * L * W;
          const T* band_data = nullptr;
          if (position_keys.has_value()) {
            at::mm_out(band, q_block, position_rows[g]);
            band_data = band.data_ptr<T>();
          }
          block_softmax<T>(scores.data_ptr<T>(), L, S, static_cast<T>(scale), bias, band_data, without_prev,
                           row_counts.data(), log_counts.data(), totals.data(),
                           lse.has_value() ? lse->data_ptr<T>() + ((bh * G + g) * R + r) * L : nullptr);
          at::Tensor out_block = out_rows[g].narrow(0, r * L, L);
          at::mm_out(out_block, scores, values);
          T* o = out_block.data_ptr<T>();
          for (int64_t a = 0; a < L; ++a) {
            const T inverse = totals[a];
#pragma omp simd
            for (int64_t e = 0; e < Dv; ++e) o[a * Dv + e] *= inverse;
          }
        }
        if (!without_prev && r + 1 < last_block)  // block r's previous block enters the cache
          linattn_native::enter_block(codes_row + r * L, prev_v, L, Dv, row_counts.data(), cache_sums);
      }
    }
  });
}

}  // namespace

namespace linattn {

void vq_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                      const at::Tensor& codebook, const at::Tensor& window,
                      const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                      const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                      int64_t full_blocks, double scale, at::Tensor out, at::Tensor final_counts,
                      at::Tensor final_sums, const c10::optional<at::Tensor>& lse, int64_t segment_blocks) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vq_block_forward", [&] {
    block_rows<scalar_t>(q, k, v, prev_codes, codebook, window, position_keys, first_k, first_v, has_prev, counts,
                         sums, full_blocks, scale, out, final_counts, final_sums, lse, segment_blocks);
  });
}

}  // namespace linattn
