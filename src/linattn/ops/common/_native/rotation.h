// Rotary positions for the native steps (ops/common/rotary.py's rotate): the pairs
// (x_2m, x_2m+1) of each of `heads` rows of D values turned by the angle position * f_m.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace linattn_native {

// cos and sin of the angles position * f_m (m < D / 2) into cos_sin [D / 2, 2].
template <typename T>
void turn_angles(const T* frequencies, int64_t D, int64_t position, T* cos_sin) {
  for (int64_t m = 0; m < D / 2; ++m) {
    const T angle = static_cast<T>(position) * frequencies[m];
    cos_sin[2 * m] = std::cos(angle);
    cos_sin[2 * m + 1] = std::sin(angle);
  }
}

// The pairs of each of `heads` rows of D values turned by the angles of cos_sin [D / 2, 2].
template <typename T>
void turn(T* x, int64_t heads, int64_t D, const T* cos_sin) {
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t m = 0; m < D / 2; ++m) {
      const T c = cos_sin[2 * m], s = cos_sin[2 * m + 1];
      T* pair = x + h * D + 2 * m;
      const T even = pair[0], odd = pair[1];
      pair[0] = even * c - odd * s;
      pair[1] = even * s + odd * c;
    }
  }
}

template <typename T>
void rotate(T* x, int64_t heads, int64_t D, const T* frequencies, int64_t position) {
  std::vector<T> cos_sin(D);
  turn_angles(frequencies, D, position, cos_sin.data());
  turn(x, heads, D, cos_sin.data());
}

// The angles of `rotate` at positions d = 0 .. count - 1, one row of turn_angles each: [count, D / 2, 2].
template <typename T>
std::vector<T> turn_table(const T* frequencies, int64_t D, int64_t count) {
  std::vector<T> table(count * D);
  for (int64_t d = 0; d < count; ++d) turn_angles(frequencies, D, d, table.data() + d * D);
  return table;
}

}  // namespace linattn_native
