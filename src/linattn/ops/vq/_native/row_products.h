// Small matrix products of the decoding steps (vq_gau_step.cpp): a few rows against a matrix
// that a token reads once, where a call into the BLAS costs more than the arithmetic.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace linattn {

// out[b, n] = bias[n] + sum_k a[b, k] w[k, n] for a [B, K], w [K, N] (both row-major), bias
// [N] or null. Every element adds its terms in ascending k, so the result does not depend on
// how the columns are split over the intra-op threads (they are when the product is large
// enough to pay for a second thread). Each row of w is read once for all B rows.
template <typename T>
void rows_times(const T* a, int64_t B, int64_t K, const T* w, int64_t N, const T* bias, T* out) {
  const int64_t grain = std::max<int64_t>(16, (int64_t(1) << 18) / std::max<int64_t>(1, B * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t b = 0; b < B; ++b) {
      T* o = out + b * N;
      for (int64_t n = n0; n < n1; ++n) o[n] = bias != nullptr ? bias[n] : T(0);
    }
    for (int64_t k = 0; k < K; ++k) {
      const T* row = w + k * N;
      for (int64_t b = 0; b < B; ++b) {
        const T x = a[b * K + k];
        T* o = out + b * N;
        for (int64_t n = n0; n < n1; ++n) o[n] += x * row[n];
      }
    }
  });
}

}  // namespace linattn
