// exp for the native kernels' softmax passes (vq_block_forward.cpp, vq_block_backward.cpp,
// vq_decode_step.cpp) and the SiLU of vq_gau_step.cpp.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace linattn_native {

// exp(x) for a float, written so that loops over it vectorise (no calls, no branches):
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 6 (Horner),
// 2^n by the exponent bits. Arguments below -87.3 (and -inf) give 0, above 88.7 give inf.
inline float fast_exp(float x) {
  const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  // round to nearest by adding and subtracting 1.5 * 2^23 (|x log2 e| < 2^22): vectorises, unlike a call
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  const float y = p * scale;
  return x < -87.3f ? 0.0f : (x > 88.7f ? std::numeric_limits<float>::infinity() : y);
}

inline float exp_of(float x) { return fast_exp(x); }
inline double exp_of(double x) { return std::exp(x); }

}  // namespace linattn_native
