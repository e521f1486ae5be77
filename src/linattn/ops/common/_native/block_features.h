// The feature maps phi of the whole-model step's kernel attention mixers (block_model_step.cpp
// gives the maps by their "feature" codes and the normalisations by "normalize").
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "block_model_step.h"
#include "fast_exp.h"

namespace linattn {

// softmax(sign * z) over n values into out.
template <typename T>
void softmax_of(const T* z, int64_t n, T sign, T* out) {
  T largest = -std::numeric_limits<T>::infinity();
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, sign * z[i]);
  T total = 0;
  for (int64_t i = 0; i < n; ++i) total += (out[i] = linattn_native::exp_of(sign * z[i] - largest));
  for (int64_t i = 0; i < n; ++i) out[i] /= total;
}

// The F log-features of an exponential map (feature 6 or 7) of a head's D values x into logs.
template <typename T>
void log_features(const BlockModelStep::Block& block, const T* x, T* logs, T* scratch) {
  const int64_t D = block.head_dim, F = block.feature_width;
  if (block.feature == 6) {
    std::copy_n(x, D, logs);
    return;
  }
  const T quarter = static_cast<T>(std::pow(static_cast<double>(D), -0.25));
  T squares = 0;
  for (int64_t i = 0; i < D; ++i) {
    scratch[i] = x[i] * quarter;
    squares += scratch[i] * scratch[i];
  }
  const T offset = squares * T(-0.5) - static_cast<T>(0.5 * std::log(static_cast<double>(F)));
  const T* W_t = block.projection_t.data_ptr<T>();  // [D, F]: rows of F, so the loop over f vectorises
  std::fill_n(logs, F, T(0));
  for (int64_t i = 0; i < D; ++i) {
    const T xi = scratch[i];
    for (int64_t f = 0; f < F; ++f) logs[f] += xi * W_t[i * F + f];
  }
  for (int64_t f = 0; f < F; ++f) logs[f] += offset;
}

// The F = feature_width(block) features phi(x) of a head's D values x into phi, normalised as the
// block's "normalize" says; `map` is the head's [D, D] Hedgehog map (feature 3), `scratch` 2 D values.
template <typename T>
void features(const BlockModelStep::Block& block, const T* x, const T* map, T* phi, T* scratch) {
  const int64_t D = block.head_dim, feature = block.feature;
  const T eps = static_cast<T>(block.feature_eps);
  if (exponential(block)) {  // "normalize" 2 (1 shifts in recur)
    log_features(block, x, phi, scratch);
    softmax_of(phi, block.feature_width, T(1), phi);
    return;
  }
  if (feature == 3) {
    std::fill_n(scratch, D, T(0));
    for (int64_t i = 0; i < D; ++i) {
      for (int64_t f = 0; f < D; ++f) scratch[f] += x[i] * map[i * D + f];
    }
    softmax_of(scratch, D, T(1), phi);
    softmax_of(scratch, D, T(-1), phi + D);
  } else if (feature == 4) {
    const int64_t R = 2 * D;
    for (int64_t i = 0; i < D; ++i) {
      scratch[i] = std::max(x[i], T(0));
      scratch[D + i] = std::max(-x[i], T(0));
    }
    for (int64_t shift = 1; shift <= block.dpfp_nu; ++shift) {
      T* out = phi + (shift - 1) * R;
      for (int64_t i = 0; i < R; ++i) out[i] = scratch[i] * scratch[(i - shift % R + R) % R];
    }
  } else if (feature == 5) {
    const T first = static_cast<T>(std::pow(static_cast<double>(D), -0.25));
    const T second = static_cast<T>(std::sqrt(2.0) * std::sqrt(static_cast<double>(D)));
    phi[0] = T(1);
    for (int64_t i = 0; i < D; ++i) phi[1 + i] = x[i] * first;
    for (int64_t i = 0; i < D; ++i) {
      for (int64_t j = 0; j < D; ++j) phi[1 + D + i * D + j] = x[i] * x[j] / second;
    }
  } else {
    for (int64_t i = 0; i < D; ++i) {
      if (feature == 1) phi[i] = x[i] > T(0) ? x[i] + T(1) : std::expm1(x[i]) + T(1);
      else if (feature == 2) phi[i] = std::max(x[i], T(0));
      else phi[i] = x[i];
    }
  }
  const int64_t n = block.feature_width;
  if (block.normalize == 2) {
    T sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += phi[i];
    for (int64_t i = 0; i < n; ++i) phi[i] = phi[i] / (sum + eps);
  } else if (block.normalize == 3) {
    T sum = 0;
    for (int64_t i = 0; i < n; ++i) sum += phi[i] * phi[i];
    const T norm = std::max(std::sqrt(sum), eps);
    for (int64_t i = 0; i < n; ++i) phi[i] = phi[i] / norm;
  }
}

}  // namespace linattn
