// The inputs shared by the native block form and its gradients (vq_block_forward.cpp,
// vq_block_backward.cpp): their shapes, dtypes and layout checked where they enter, every code
// in [0, S), and the sizes the kernels read.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "native_checks.h"

namespace linattn_native {

struct BlockSizes {
  int64_t B, Hkv, G, R, L, Dk, S, Dv;
  int64_t Wh, Wg;  // the window's bias: per kv head (Hkv) or shared (1), per query group (G) or shared
  int64_t Ph, Pg;  // the position keys, likewise (1, 1 without them)
};

// q [B, Hkv, G, R, L, Dk], k [B, Hkv, R, L, Dk], v [B, Hkv, R, L, Dv], prev_codes [B, Hkv, R, L],
// codebook [Hkv, S, Dk], window [Hkv|1, G|1, L, 2L], position_keys [Hkv|1, G|1, L + 1, Dk] or none,
// first_k [B, Hkv, L, Dk], first_v [B, Hkv, L, Dv], counts [B, Hkv, S], sums [B, Hkv, S, Dv],
// out [B, Hkv, G, R, L, Dv].
inline BlockSizes check_block_inputs(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& prev_codes, const at::Tensor& codebook,
                                     const at::Tensor& window, const c10::optional<at::Tensor>& position_keys,
                                     const at::Tensor& first_k, const at::Tensor& first_v, const at::Tensor& counts,
                                     const at::Tensor& sums, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 6 && codebook.dim() == 3 && window.dim() == 4, what,
              ": q [B, Hkv, G, R, L, Dk], codebook [Hkv, S, Dk], window [Hkv|1, G|1, L, 2L]");
  BlockSizes n{q.size(0), q.size(1), q.size(2), q.size(3), q.size(4), q.size(5), codebook.size(1), v.size(-1),
               window.size(0), window.size(1), 1, 1};
  const auto dtype = q.scalar_type();
  TORCH_CHECK((n.Wh == 1 || n.Wh == n.Hkv) && (n.Wg == 1 || n.Wg == n.G), what, ": window has shape ",
              window.sizes(), " for Hkv = ", n.Hkv, ", G = ", n.G);
  check_tensor(what, q, "q", dtype, {n.B, n.Hkv, n.G, n.R, n.L, n.Dk});
  check_tensor(what, k, "k", dtype, {n.B, n.Hkv, n.R, n.L, n.Dk});
  check_tensor(what, v, "v", dtype, {n.B, n.Hkv, n.R, n.L, n.Dv});
  check_tensor(what, prev_codes, "prev_codes", at::kLong, {n.B, n.Hkv, n.R, n.L});
  check_tensor(what, codebook, "codebook", dtype, {n.Hkv, n.S, n.Dk});
  check_tensor(what, window, "window", dtype, {n.Wh, n.Wg, n.L, 2 * n.L});
  if (position_keys.has_value()) {
    const at::Tensor& P = *position_keys;
    TORCH_CHECK(P.dim() == 4 && (P.size(0) == 1 || P.size(0) == n.Hkv) && (P.size(1) == 1 || P.size(1) == n.G),
                what, ": position_keys has shape ", P.sizes(), ", expected [Hkv|1, G|1, L + 1, Dk]");
    n.Ph = P.size(0), n.Pg = P.size(1);
    check_tensor(what, P, "position_keys", dtype, {n.Ph, n.Pg, n.L + 1, n.Dk});
  }
  check_tensor(what, first_k, "first_k", dtype, {n.B, n.Hkv, n.L, n.Dk});
  check_tensor(what, first_v, "first_v", dtype, {n.B, n.Hkv, n.L, n.Dv});
  check_tensor(what, counts, "counts", dtype, {n.B, n.Hkv, n.S});
  check_tensor(what, sums, "sums", dtype, {n.B, n.Hkv, n.S, n.Dv});
  check_tensor(what, out, "out", dtype, {n.B, n.Hkv, n.G, n.R, n.L, n.Dv});
  const int64_t* code_data = prev_codes.data_ptr<int64_t>();
  for (int64_t i = 0, count = prev_codes.numel(); i < count; ++i)
    TORCH_CHECK(code_data[i] >= 0 && code_data[i] < n.S, what, ": code ", code_data[i], " outside [0, ", n.S, ")");
  return n;
}

}  // namespace linattn_native
