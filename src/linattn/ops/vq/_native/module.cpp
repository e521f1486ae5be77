// The Python module of linattn's native VQ kernels (ops/vq/native.py builds it): the
// decoding step (vq_decode_step.cpp), the block form without gradients (vq_block_forward.cpp)
// and the nearest-code search with the check that keys are their codes (vq_codes.cpp).
#include <torch/extension.h>

namespace linattn {

void vq_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& search_t,
                    const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                    at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, double scale,
                    const c10::optional<at::Tensor>& relative, bool keys_are_codes, at::Tensor out,
                    at::Tensor new_codes);

void vq_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                      const at::Tensor& codebook, const at::Tensor& window,
                      const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                      const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                      int64_t full_blocks, double scale, at::Tensor out, at::Tensor final_counts,
                      at::Tensor final_sums);

void vq_nearest_codes(const at::Tensor& keys, const at::Tensor& codebook, const at::Tensor& norms, at::Tensor codes,
                      const c10::optional<at::Tensor>& chosen, const c10::optional<at::Tensor>& errors);

bool vq_keys_are_codes(const at::Tensor& k_hat, const at::Tensor& codes, const at::Tensor& codebook);

}  // namespace linattn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vq_decode_step", &linattn::vq_decode_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "One Transformer-VQ decoding step over the resident buffer (vq_decode_step.cpp).");
  m.def("vq_block_forward", &linattn::vq_block_forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Transformer-VQ's causal block form without gradients, fused per block (vq_block_forward.cpp).");
  m.def("vq_nearest_codes", &linattn::vq_nearest_codes, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The nearest code of every key (vq_codes.cpp).");
  m.def("vq_keys_are_codes", &linattn::vq_keys_are_codes, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Whether keys are the codebook's rows at their codes (vq_codes.cpp).");
}
