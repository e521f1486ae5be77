// Rotary positions for the native steps (ops/common/rotary.py's rotate): the pairs
// (x_2m, x_2m+1) of each of `heads` rows of D values turned by the angle position * f_m.
#pragma once

#include <cmath>
#include <cstdint>

namespace linattn_native {

template <typename T>
void rotate(T* x, int64_t heads, int64_t D, const T* frequencies, int64_t position) {
  for (int64_t m = 0; m < D / 2; ++m) {
    const T angle = static_cast<T>(position) * frequencies[m];
    const T c = std::cos(angle), s = std::sin(angle);
    for (int64_t h = 0; h < heads; ++h) {
      T* pair = x + h * D + 2 * m;
      const T even = pair[0], odd = pair[1];
      pair[0] = even * c - odd * s;
      pair[1] = even * s + odd * c;
    }
  }
}

}  // namespace linattn_native
