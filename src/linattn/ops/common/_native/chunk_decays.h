// The decay terms of a chunk of C positions with log decays g <= 0 (-inf resets), one per step
// (Fg = 1) or per feature channel (Fg = F), that the decayed chunk kernels share
// (kernel/_native/decayed_scan.cpp, delta/_native/delta_scan.cpp). Inside the chunk:
//
//   P_i = sum_{m <= i} g_m,   E_j = sum_{m > j} g_m,   L_ij = sum_{j < m <= i} g_m
//
// Every exponent is a sum of decays (never a difference), so each factor is at most 1 and a reset
// gives 0, not NaN.
#pragma once

#include <algorithm>
#include <cstdint>

#include "fast_exp.h"
#include "tile_products.h"

namespace linattn_native {

// The decay of channel f (or of the step) at row i of a [L, Fg] table.
template <typename T>
T decay_at(const T* table, int64_t Fg, int64_t i, int64_t f) {
  return table[i * Fg + (Fg == 1 ? 0 : f)];
}

// prefix[i] = P_i and suffix[j] = E_j ([L, Fg] each) of the chunk's decays gc [L, Fg]; run [Fg].
template <typename T>
void decay_sums(const T* gc, int64_t L, int64_t Fg, T* run, T* prefix, T* suffix) {
  std::fill(run, run + Fg, T(0));
  for (int64_t i = 0; i < L; ++i)
    for (int64_t f = 0; f < Fg; ++f) prefix[i * Fg + f] = (run[f] += gc[i * Fg + f]);
  std::fill(run, run + Fg, T(0));
  for (int64_t j = L - 1; j >= 0; --j)
    for (int64_t f = 0; f < Fg; ++f) {
      suffix[j * Fg + f] = run[f];
      run[f] += gc[j * Fg + f];
    }
}

// out[i, f] = rows[i, f] exp(table[i, f]) over L rows of F (table [L, Fg]: P or E).
template <typename T>
void decay_rows(const T* rows, int64_t L, int64_t F, const T* table, int64_t Fg, T* out) {
  for (int64_t i = 0; i < L; ++i)
    for (int64_t f = 0; f < F; ++f) out[i * F + f] = rows[i * F + f] * exp_of(decay_at(table, Fg, i, f));
}

// out[i, j] = sum_f a_if k_jf exp(L_ijf) for j <= i (j < i when `strict`), zero elsewhere, over the
// L rows of a [L, F] and k [L, F]; gc the chunk's decays [L, Fg] (null: none). One decay per step
// (or none): the product a k^T (k_t = k^T [F, L]) times exp(L_ij); per channel, pair by pair with
// L_ij summed from i down to j (run [F]).
template <typename T>
void decayed_scores(int64_t L, int64_t F, int64_t Fg, const T* a, const T* k, const T* k_t, const T* gc, bool strict,
                    T* run, T* out) {
  if (gc != nullptr && Fg != 1) {
    for (int64_t i = 0; i < L; ++i) {
      std::fill(run, run + F, T(0));
      std::fill(out + i * L, out + (i + 1) * L, T(0));
      for (int64_t j = i; j >= 0; --j) {
        const T* ai = a + i * F;
        const T* kj = k + j * F;
        const T* gj = gc + j * F;
        T sum = 0;
        for (int64_t f = 0; f < F; ++f) {
          sum += ai[f] * kj[f] * exp_of(run[f]);
          run[f] += gj[f];
        }
        if (j < i || !strict) out[i * L + j] = sum;
      }
    }
    return;
  }
  tile_product(L, L, F, a, F, k_t, L, out, L, false);
  for (int64_t i = 0; i < L; ++i) {
    T sum = 0;  // L_ij, from j = i down
    for (int64_t j = i; j >= 0 && gc != nullptr; --j) {
      out[i * L + j] *= exp_of(sum);
      sum += gc[j];
    }
    std::fill(out + i * L + (strict ? i : i + 1), out + (i + 1) * L, T(0));
  }
}

}  // namespace linattn_native
