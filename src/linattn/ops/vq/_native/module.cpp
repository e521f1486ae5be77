// The Python module of linattn's native VQ kernels (ops/vq/native.py builds it): the
// decoding step (vq_decode_step.cpp), the block form and its gradients (vq_block_forward.cpp,
// vq_block_backward.cpp),
// the nearest-code search with the check that keys are their codes (vq_codes.cpp) and one token
// through a gated attention unit (vq_gau_step.cpp) or a whole model (vq_model_step.cpp).
#include <torch/extension.h>

#include "vq_model_step.h"

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
                      at::Tensor final_sums, const c10::optional<at::Tensor>& lse, int64_t segment_blocks);

void vq_block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                       const at::Tensor& codebook, const at::Tensor& window,
                       const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                       const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                       double scale, const at::Tensor& out, const at::Tensor& d_out, const at::Tensor& lse,
                       bool prev_grad, at::Tensor dq, at::Tensor dk, at::Tensor dv, at::Tensor d_first_k,
                       at::Tensor d_first_v, const c10::optional<at::Tensor>& d_codebook,
                       const c10::optional<at::Tensor>& d_window, const c10::optional<at::Tensor>& d_position_keys,
                       int64_t segment_blocks);

void vq_nearest_codes(const at::Tensor& keys, const at::Tensor& codebook, const at::Tensor& norms, at::Tensor codes,
                      const c10::optional<at::Tensor>& chosen, const c10::optional<at::Tensor>& errors);

bool vq_keys_are_codes(const at::Tensor& k_hat, const at::Tensor& codes, const at::Tensor& codebook);

void vq_gau_step(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                 double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                 const at::Tensor& bias_reversed, const at::Tensor& output_t, const at::Tensor& search_t,
                 const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                 at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, bool keys_are_codes, double commitment_weight,
                 at::Tensor y, at::Tensor new_codes, at::Tensor commit);

}  // namespace linattn

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vq_decode_step", &linattn::vq_decode_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "One Transformer-VQ decoding step over the resident buffer (vq_decode_step.cpp).");
  m.def("vq_block_forward", &linattn::vq_block_forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Transformer-VQ's causal block form, fused per block (vq_block_forward.cpp).");
  m.def("vq_block_backward", &linattn::vq_block_backward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The gradients of the causal block form, fused per block (vq_block_backward.cpp).");
  m.def("vq_nearest_codes", &linattn::vq_nearest_codes, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The nearest code of every key (vq_codes.cpp).");
  m.def("vq_keys_are_codes", &linattn::vq_keys_are_codes, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Whether keys are the codebook's rows at their codes (vq_codes.cpp).");
  m.def("vq_gau_step", &linattn::vq_gau_step, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "One token through a Transformer-VQ gated attention unit (vq_gau_step.cpp).");
  pybind11::class_<linattn::VQModelStep>(m, "VQModelStep",
                                         "One token through a whole Transformer-VQ model (vq_model_step.cpp).")
      .def(pybind11::init<at::Tensor, at::Tensor, double, at::Tensor, int64_t>())
      .def("add_unit", &linattn::VQModelStep::add_unit)
      .def("set_window", &linattn::VQModelStep::set_window)
      .def("step", &linattn::VQModelStep::step, pybind11::arg("ids"), pybind11::arg("p"), pybind11::arg("logits"),
           pybind11::arg("codes"), pybind11::arg("greedy") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("units", &linattn::VQModelStep::units);
}
