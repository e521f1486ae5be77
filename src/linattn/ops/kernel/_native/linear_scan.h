// Causal kernel attention's chunk form (linear_scan.cpp) and, without gradients, its decayed chunk
// form (decayed_scan.cpp); kernel/native_scan.py calls them.
#pragma once

#include <ATen/ATen.h>

namespace linattn {

// With phi the feature map (0: the inputs are the features, 1: elu(x) + 1, 2: relu, 3: x) and a
// = scale on the queries: num[n, g, i] = phi(a q[n, g, i]) (S0[n] + sum_{j <= i} phi(k[n, j])
// v[n, j]^T) and, with a normalizer, den[n, g, i] = phi(a q[n, g, i]) . (z0[n] + sum_{j <= i}
// phi(k[n, j])); out = num / (den + eps) with `divide`, else num. The final state and normalizer
// after the last position. q [N, G, T, F], k [N, T, F], v [N, T, E], state [N, F, E], normalizer
// [N, F], out [N, G, T, E], den [N, G, T].
void linear_scan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
                         const c10::optional<at::Tensor>& normalizer, int64_t chunk, int64_t segment_chunks,
                         int64_t feature_map, double scale, bool divide, double eps, at::Tensor out,
                         const c10::optional<at::Tensor>& den, at::Tensor final_state,
                         const c10::optional<at::Tensor>& final_normalizer);

// The gradients of linear_scan_forward's inputs from those of its outputs: with `divide`, the
// forward's out and den and no d_den; without it, d_den with a normalizer. d_final_state and
// d_final_normalizer may be absent (zero).
void linear_scan_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
                          const c10::optional<at::Tensor>& normalizer, const c10::optional<at::Tensor>& out,
                          const c10::optional<at::Tensor>& den, const at::Tensor& d_out,
                          const c10::optional<at::Tensor>& d_den, const c10::optional<at::Tensor>& d_final_state,
                          const c10::optional<at::Tensor>& d_final_normalizer, int64_t chunk, int64_t segment_chunks,
                          int64_t feature_map, double scale, bool divide, double eps, at::Tensor dq, at::Tensor dk,
                          at::Tensor dv, at::Tensor d_state, const c10::optional<at::Tensor>& d_normalizer);

// linear_scan_forward with log decays g [N, T, 1] (one per step) or [N, T, F] (per channel):
// S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T, z_t = exp(g_t) z_{t-1} + phi(k_t).
void decayed_scan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& state, const c10::optional<at::Tensor>& normalizer, int64_t chunk,
                          int64_t segment_chunks, int64_t feature_map, double scale, bool divide, double eps,
                          at::Tensor out, const c10::optional<at::Tensor>& den, at::Tensor final_state,
                          const c10::optional<at::Tensor>& final_normalizer);

}  // namespace linattn
