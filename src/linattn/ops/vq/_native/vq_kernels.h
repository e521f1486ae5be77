// The entry points of linattn's native VQ kernels, one declaration each (the .cpp files named
// beside them define them; module.cpp binds them to Python, and the unit and model steps call
// the decoding step and the unit step).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace linattn {

// vq_decode_step.cpp (rerope: ReRoPE's window w, 0: off, with rerope_frequencies [Dk / 2]; given_codes
// [B, Hkv]: the new codes, where the quantizer is not the nearest-code search; soft_keys: k is a soft
// key, written as it is, codes and new_codes neither read nor written)
void vq_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& search_t,
                    const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                    at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, double scale,
                    const c10::optional<at::Tensor>& relative, bool keys_are_codes, int64_t rerope,
                    const c10::optional<at::Tensor>& rerope_frequencies, const c10::optional<at::Tensor>& given_codes,
                    bool soft_keys, at::Tensor out, at::Tensor new_codes);

// vq_block_forward.cpp
void vq_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                      const at::Tensor& codebook, const at::Tensor& window,
                      const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                      const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                      int64_t full_blocks, double scale, at::Tensor out, at::Tensor final_counts,
                      at::Tensor final_sums, const c10::optional<at::Tensor>& lse, int64_t segment_blocks);

// vq_block_backward.cpp
void vq_block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                       const at::Tensor& codebook, const at::Tensor& window,
                       const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                       const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                       double scale, const at::Tensor& out, const at::Tensor& d_out, const at::Tensor& lse,
                       bool prev_grad, at::Tensor dq, at::Tensor dk, at::Tensor dv, at::Tensor d_first_k,
                       at::Tensor d_first_v, const c10::optional<at::Tensor>& d_codebook,
                       const c10::optional<at::Tensor>& d_window, const c10::optional<at::Tensor>& d_position_keys,
                       int64_t segment_blocks);

// vq_codes.cpp
void vq_nearest_codes(const at::Tensor& keys, const at::Tensor& codebook, const at::Tensor& norms, at::Tensor codes,
                      const c10::optional<at::Tensor>& chosen, const c10::optional<at::Tensor>& errors);

bool vq_keys_are_codes(const at::Tensor& k_hat, const at::Tensor& codes, const at::Tensor& codebook);

// vq_gau_step.cpp (rerope, rerope_frequencies: as vq_decode_step's, with ReRoPE no u and no relative terms;
// fsq: empty, or a finite scalar quantizer's w_in [d, d_k], half, offset, shift, radius [d] and radix [d] int64;
// soft_temperature > 0: soft VQ, the key's soft assignment written into `codes` [B, 1, 2L, S] in the dtype)
void vq_gau_step(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                 double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                 const at::Tensor& bias_reversed, const at::Tensor& output_t, const at::Tensor& search_t,
                 const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                 at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, bool keys_are_codes, double commitment_weight,
                 int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
                 const std::vector<at::Tensor>& fsq, double soft_temperature, at::Tensor y, at::Tensor new_codes,
                 at::Tensor commit);

// vq_gau_step.cpp: the unit with exact softmax over a preallocated cache (length: its rows so far)
void gau_softmax_step(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                      double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                      const at::Tensor& bias_reversed, const at::Tensor& output_t, at::Tensor keys, at::Tensor values,
                      int64_t length, int64_t L, bool entropy, at::Tensor y);

}  // namespace linattn
