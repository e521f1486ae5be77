// The delta rule's and the gated delta rule's chunk form without gradients (delta_scan.cpp);
// delta/native_chunk.py calls it.
#pragma once

#include <ATen/ATen.h>

namespace linattn {

// Per row n (a sequence's key/value head) with memory S [F, E] from memory[n], position after
// position: S <- diag(exp(g_t)) S (when g is given), u_t = beta_t (v_t - S^T k_t), S <- S + k_t u_t^T,
// out[n, h, t] = scale S^T q[n, h, t] for every query head h; final_memory[n] is S after the last
// position. q [N, G, T, F], k [N, T, F], v [N, T, E], beta [N, T], g [N, T, 1] (one log decay per
// step) or [N, T, F] (per key channel), memory [N, F, E]; out [N, G, T, E], final_memory [N, F, E].
void delta_scan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                        const c10::optional<at::Tensor>& g, const at::Tensor& memory, int64_t chunk, double scale,
                        at::Tensor out, at::Tensor final_memory);

}  // namespace linattn
