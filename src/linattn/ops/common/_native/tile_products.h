// Matrix products of tiles that fit the core's first cache (the chunk kernels: a chunk's C x C
// scores, its F x E state), where a call into the BLAS costs as much as the arithmetic.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace linattn_native {

// One 64-byte vector of T (16 floats or 8 doubles), whatever vector width the compiler targets.
template <typename T>
struct Lanes {
  typedef T V __attribute__((vector_size(64)));
  static constexpr int64_t n = 64 / sizeof(T);
  static V load(const T* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
  }
  static void store(T* p, V v) { std::memcpy(p, &v, sizeof(V)); }
};

// Which terms of A B a row may have: all of them, or those of a lower (upper) triangular A:
// row i of A is zero past column i (before column i).
enum class Triangle { kFull, kLower, kUpper };

// R rows of C times NV vectors of columns: the R * NV sums stay in registers over the k loop,
// which runs over [k0, k1).
template <typename T, int R, int NV>
inline void tile(int64_t k0, int64_t k1, const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                 bool accumulate) {
  using L = Lanes<T>;
  using V = typename L::V;
  constexpr int64_t n = L::n;
  V c[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) c[r][j] = accumulate ? L::load(C + r * ldc + j * n) : V{};
  for (int64_t k = k0; k < k1; ++k) {
    const T* b = B + k * ldb;
    V bv[NV];
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) bv[j] = L::load(b + j * n);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const T a = A[r * lda + k];
#pragma GCC unroll 8
      for (int j = 0; j < NV; ++j) c[r][j] += a * bv[j];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) L::store(C + r * ldc + j * n, c[r][j]);
}

// The k range a block of rows [i, i + rows) needs under `triangle`.
inline void k_range(Triangle triangle, int64_t i, int64_t rows, int64_t K, int64_t* k0, int64_t* k1) {
  *k0 = triangle == Triangle::kUpper ? std::min(i, K) : 0;
  *k1 = triangle == Triangle::kLower ? std::min(i + rows, K) : K;
}

// NV vectors of columns for all M rows, in blocks of R rows.
template <typename T, int NV>
inline void panel(Triangle triangle, int64_t M, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                  int64_t ldc, bool accumulate) {
  constexpr int R = NV >= 4 ? 4 : (NV == 2 ? 6 : 8);
  int64_t i = 0, k0, k1;
  for (; i + R <= M; i += R) {
    k_range(triangle, i, R, K, &k0, &k1);
    tile<T, R, NV>(k0, k1, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  }
  for (; i < M; ++i) {
    k_range(triangle, i, 1, K, &k0, &k1);
    tile<T, 1, NV>(k0, k1, A + i * lda, lda, B, ldb, C + i * ldc, ldc, accumulate);
  }
}

// C[M, N] = (accumulate ? C : 0) + A[M, K] B[K, N], row-major with leading dimensions lda, ldb,
// ldc; with a triangular A (`triangle`) only the terms its nonzero entries give (the entries
// outside the triangle must be zero within each block of rows: they may still be read). Every
// element adds its terms in ascending k, so a product's bits do not depend on the thread that
// computes it.
template <typename T>
inline void tile_product(int64_t M, int64_t N, int64_t K, const T* A, int64_t lda, const T* B, int64_t ldb, T* C,
                         int64_t ldc, bool accumulate, Triangle triangle = Triangle::kFull) {
  constexpr int64_t n = Lanes<T>::n;
  int64_t j = 0;
  for (; j + 4 * n <= N; j += 4 * n) panel<T, 4>(triangle, M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
  if (j + 2 * n <= N) {
    panel<T, 2>(triangle, M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
    j += 2 * n;
  }
  if (j + n <= N) {
    panel<T, 1>(triangle, M, K, A, lda, B + j, ldb, C + j, ldc, accumulate);
    j += n;
  }
  if (j < N) {  // the last columns, fewer than a vector
    int64_t k0, k1;
    for (int64_t i = 0; i < M; ++i) {
      k_range(triangle, i, 1, K, &k0, &k1);
      T* c = C + i * ldc;
      for (int64_t col = j; col < N; ++col) {
        T sum = accumulate ? c[col] : T(0);
        for (int64_t k = k0; k < k1; ++k) sum += A[i * lda + k] * B[k * ldb + col];
        c[col] = sum;
      }
    }
  }
}

// out[cols, rows] = in[rows, cols]^T (in with leading dimension ld_in, out with ld_out).
template <typename T>
inline void transpose(int64_t rows, int64_t cols, const T* in, int64_t ld_in, T* out, int64_t ld_out) {
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[j * ld_out + i] = in[i * ld_in + j];
}

}  // namespace linattn_native
