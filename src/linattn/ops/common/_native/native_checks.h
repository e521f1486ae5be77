// The check of a tensor that a native kernel reads or writes through its data pointer.
#pragma once

#include <ATen/ATen.h>

namespace linattn_native {

// A contiguous CPU tensor of `dtype` and `shape`, or an error naming it; `what` names the kernel.
inline void check_tensor(const char* what, const at::Tensor& t, const char* name, at::ScalarType dtype,
                         at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, what, ": ", name, " has shape ", t.sizes(), ", expected ", shape);
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype, what, ": ", name,
              " must be a contiguous CPU tensor of ", dtype, ", got ", t.scalar_type(), " on ", t.device(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

}  // namespace linattn_native
