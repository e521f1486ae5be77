// The checks of a tensor that a native kernel reads or writes through its data pointer.
#pragma once

#include <ATen/ATen.h>

namespace linattn_native {

// `t` has `shape`, is a contiguous CPU tensor of `dtype`; else an error naming `kernel` and `name`.
inline void check_buffer(const char* kernel, const at::Tensor& t, const char* name, at::ScalarType dtype,
                         at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, kernel, " (native): ", name, " has shape ", t.sizes(), ", expected ", shape);
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype, kernel, " (native): ", name,
              " must be a contiguous CPU tensor of ", dtype, ", got ", t.scalar_type(), " on ", t.device(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace linattn_native
