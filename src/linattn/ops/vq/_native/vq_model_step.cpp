// One generated token through a whole Transformer-VQ language model (LM of GAU pairs), in one
// call, for CPU tensors in float32 or float64:
//
//   x        = E[ids]                                              [B, d]
//   x        = x + unit(x)      for every gated attention unit, in order (vq_gau_step.cpp)
//   logits   = (x / sqrt(mean(x^2) + eps) * g) H^T                  the final RMSNorm, the head
//   token    = argmax logits (first largest; -1 for a row that is not all finite), when asked
//
// The constants and the resident buffers are held by the object (registered once, buffers
// replaced when a block completes), so a token costs one call from Python.
#include "vq_model_step.h"

#include "lm_ends.h"
#include "vq_kernels.h"

namespace linattn {

VQModelStep::VQModelStep(at::Tensor embed, at::Tensor norm_weight, double norm_eps, at::Tensor head_t,
                         int64_t block_size)
    : embed_(std::move(embed)), norm_weight_(std::move(norm_weight)), head_t_(std::move(head_t)),
      norm_eps_(norm_eps), block_size_(block_size) {
  TORCH_CHECK(embed_.dim() == 2 && head_t_.dim() == 2 && head_t_.size(0) == embed_.size(1) &&
                  norm_weight_.dim() == 1 && norm_weight_.size(0) == embed_.size(1),
              "VQModelStep (native): embed [V, d], norm_weight [d], head_t [d, V']");
  TORCH_CHECK(embed_.scalar_type() == head_t_.scalar_type() && embed_.scalar_type() == norm_weight_.scalar_type() &&
                  embed_.is_contiguous() && head_t_.is_contiguous() && norm_weight_.is_contiguous(),
              "VQModelStep (native): embed, norm_weight and head_t must be contiguous, of one dtype");
}

void VQModelStep::add_unit(std::vector<at::Tensor> constants, const c10::optional<at::Tensor>& input_shift,
                           double eps, int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
                           std::vector<at::Tensor> fsq, double soft_temperature) {
  TORCH_CHECK(constants.size() == 8, "VQModelStep (native): a unit has 8 constants, got ", constants.size());
  units_.push_back(Unit{std::move(constants), input_shift, eps, rerope, rerope_frequencies, std::move(fsq),
                        soft_temperature, {}, false});
}

void VQModelStep::set_window(int64_t unit, at::Tensor keys, at::Tensor values, at::Tensor codes, at::Tensor mask,
                             bool keys_are_codes) {
  TORCH_CHECK(unit >= 0 && unit < units(), "VQModelStep (native): no unit ", unit);
  units_[unit].window = {std::move(keys), std::move(values), std::move(codes), std::move(mask)};
  units_[unit].keys_are_codes = keys_are_codes;
}

void VQModelStep::step(const at::Tensor& ids, int64_t p, at::Tensor logits, at::Tensor codes,
                       const c10::optional<at::Tensor>& greedy) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "VQModelStep (native): ids must be [B] int64");
  const int64_t B = ids.size(0), d = embed_.size(1), n = units();
  TORCH_CHECK(codes.sizes() == at::IntArrayRef({n, B, 1}) && codes.scalar_type() == at::kLong && codes.is_contiguous(),
              "VQModelStep (native): codes must be a contiguous [units, B, 1] int64 tensor");
  linattn_native::check_outputs("VQModelStep (native)", logits, B, head_t_.size(1), embed_.scalar_type(), greedy);
  const at::Tensor id_rows = linattn_native::checked_ids("VQModelStep (native)", ids, embed_.size(0));
  const int64_t* id = id_rows.data_ptr<int64_t>();
  at::Tensor x = at::empty({B, d}, embed_.options());
  at::Tensor y = at::empty({B, d}, embed_.options());
  at::Tensor commit = at::empty({}, embed_.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "VQModelStep", [&] {
    scalar_t* rows = x.data_ptr<scalar_t>();
    linattn_native::embed_rows(embed_.data_ptr<scalar_t>(), id, B, d, rows);
    for (int64_t u = 0; u < n; ++u) {
      const Unit& unit = units_[u];
      TORCH_CHECK(unit.window.size() == 4, "VQModelStep (native): unit ", u, " has no buffer (set_window)");
      const std::vector<at::Tensor>& c = unit.constants;
      vq_gau_step(x, c[0], unit.input_shift, unit.eps, c[1], c[2], c[3], c[4], c[5], c[6], c[7], unit.window[0],
                  unit.window[1], unit.window[2], unit.window[3], block_size_, p, unit.keys_are_codes, 0.0,
                  unit.rerope, unit.rerope_frequencies, unit.fsq, unit.soft_temperature, y, codes[u], commit);
      const scalar_t* added = y.data_ptr<scalar_t>();
      for (int64_t i = 0; i < B * d; ++i) rows[i] += added[i];
    }
    linattn_native::final_logits(rows, B, d, norm_weight_.data_ptr<scalar_t>(), norm_eps_,
                                 head_t_.data_ptr<scalar_t>(), head_t_.size(1), logits.data_ptr<scalar_t>(),
                                 greedy.has_value() ? greedy->data_ptr<int64_t>() : nullptr);
  });
}

}  // namespace linattn
