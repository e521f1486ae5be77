// Small matrix products of the decoding steps (vq_gau_step.cpp): a few rows against a matrix
// that a token reads once, where a call into the BLAS costs more than the arithmetic.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace linattn {

// out[b, n] = bias[n] + sum_k a[b, k] w[k, n] for a [B, K], w [K, N] (both row-major), bias
// [N] or null. The columns go in tiles of kTile whose sums stay in registers over the whole k
// loop; the tiles are split over the intra-op threads when the product is large enough to pay
// for a second thread. A tile is computed the same way whichever thread takes it (every element
// adds its terms in ascending k), so the result does not depend on the thread count.
template <typename T>
void rows_times(const T* a, int64_t B, int64_t K, const T* w, int64_t N, const T* bias, T* out) {
  constexpr int64_t kTile = 64;
  const int64_t tiles = (N + kTile - 1) / kTile;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 18) / std::max<int64_t>(1, B * K * kTile));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kTile;
      for (int64_t b = 0; b < B; ++b) {
        const T* x = a + b * K;
        T* o = out + b * N + n;
        if (n + kTile <= N) {
          T sums[kTile];
          for (int64_t j = 0; j < kTile; ++j) sums[j] = bias != nullptr ? bias[n + j] : T(0);
          for (int64_t k = 0; k < K; ++k) {
            const T xk = x[k];
            const T* row = w + k * N + n;
            for (int64_t j = 0; j < kTile; ++j) sums[j] += xk * row[j];
          }
          for (int64_t j = 0; j < kTile; ++j) o[j] = sums[j];
        } else {  // the last, partial tile
          for (int64_t j = 0; n + j < N; ++j) {
            T sum = bias != nullptr ? bias[n + j] : T(0);
            for (int64_t k = 0; k < K; ++k) sum += x[k] * w[k * N + n + j];
            o[j] = sum;
          }
        }
      }
    }
  });
}

}  // namespace linattn
