// The Python module of linattn's native kernels (ops/common/native.py builds it): the VQ
// decoding step (vq_decode_step.cpp), the block form and its gradients (vq_block_forward.cpp,
// vq_block_backward.cpp), the nearest-code search with the check that keys are their codes
// (vq_codes.cpp), one token through a gated attention unit, with VQ or exact softmax (vq_gau_step.cpp), or a whole VQ model
// (vq_model_step.cpp), one token through a whole model of pre-norm blocks (block_model_step.cpp), and
// causal kernel attention's chunk form with its gradients (kernel/_native/linear_scan.cpp) and its
// decayed chunk form (kernel/_native/decayed_scan.cpp), and the delta rule's chunk form with or
// without decay (delta/_native/delta_scan.cpp).
#include <torch/extension.h>

#include "block_model_step.h"
#include "delta_scan.h"
#include "linear_scan.h"
#include "vq_kernels.h"
#include "vq_model_step.h"

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
  m.def("linear_scan_forward", &linattn::linear_scan_forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Causal kernel attention's chunk form (linear_scan.cpp).");
  m.def("linear_scan_backward", &linattn::linear_scan_backward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The gradients of the chunk form (linear_scan.cpp).");
  m.def("decayed_scan_forward", &linattn::decayed_scan_forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "Causal kernel attention's decayed chunk form, without gradients (decayed_scan.cpp).");
  m.def("delta_scan_forward", &linattn::delta_scan_forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "The (gated) delta rule's chunk form, without gradients (delta_scan.cpp).");
  pybind11::class_<linattn::VQModelStep>(m, "VQModelStep",
                                         "One token through a whole Transformer-VQ model (vq_model_step.cpp).")
      .def(pybind11::init<at::Tensor, at::Tensor, double, at::Tensor, int64_t>())
      .def("add_unit", &linattn::VQModelStep::add_unit)
      .def("set_window", &linattn::VQModelStep::set_window)
      .def("step", &linattn::VQModelStep::step, pybind11::arg("ids"), pybind11::arg("p"), pybind11::arg("logits"),
           pybind11::arg("codes"), pybind11::arg("greedy") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("units", &linattn::VQModelStep::units);
  pybind11::class_<linattn::BlockModelStep>(m, "BlockModelStep",
                                            "One token through a whole model of pre-norm blocks (block_model_step.cpp).")
      .def(pybind11::init<at::Tensor, at::Tensor, double, at::Tensor>())
      .def("add_block", &linattn::BlockModelStep::add_block)
      .def("set_state", &linattn::BlockModelStep::set_state, pybind11::arg("block"), pybind11::arg("state"),
           pybind11::arg("length") = 0)
      .def("cache_length", &linattn::BlockModelStep::cache_length)
      .def("add_vq_unit", &linattn::BlockModelStep::add_vq_unit)
      .def("add_softmax_unit", &linattn::BlockModelStep::add_softmax_unit)
      .def("set_window", &linattn::BlockModelStep::set_window)
      .def("step", &linattn::BlockModelStep::step, pybind11::arg("ids"), pybind11::arg("position"),
           pybind11::arg("logits"), pybind11::arg("greedy") = pybind11::none(), pybind11::arg("vq_position") = 0,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("blocks", &linattn::BlockModelStep::blocks);
}
