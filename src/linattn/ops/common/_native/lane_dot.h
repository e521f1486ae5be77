// The dot product of the native steps over rows of keys (block_model_step.cpp, vq_decode_step.cpp).
#pragma once

#include <cstdint>

namespace linattn_native {

// a.b over n values, in 16 lanes (a fixed order of terms that vectorises: lane l adds the
// products i = l mod 16 in order, then the lanes are added pairwise, then the tail).
template <typename T>
T dot(const T* a, const T* b, int64_t n) {
  constexpr int64_t kLanes = 16;
  T lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[l] += a[i + l] * b[i + l];
  }
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  }
  T sum = lanes[0];
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

}  // namespace linattn_native
