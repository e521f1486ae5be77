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

#include <algorithm>
#include <cmath>

#include "row_products.h"
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
                           double eps) {
  TORCH_CHECK(constants.size() == 8, "VQModelStep (native): a unit has 8 constants, got ", constants.size());
  units_.push_back(Unit{std::move(constants), input_shift, eps, {}, false});
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
  TORCH_CHECK(logits.sizes() == at::IntArrayRef({B, head_t_.size(1)}) && logits.is_contiguous() &&
                  logits.scalar_type() == embed_.scalar_type(),
              "VQModelStep (native): logits must be a contiguous [B, V] tensor of the model's dtype");
  TORCH_CHECK(!greedy.has_value() || (greedy->sizes() == at::IntArrayRef({B}) && greedy->scalar_type() == at::kLong &&
                                      greedy->is_contiguous()),
              "VQModelStep (native): greedy must be a contiguous [B] int64 tensor");
  const int64_t vocab = embed_.size(0);
  const at::Tensor ids_rows = ids.contiguous();
  const int64_t* id = ids_rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(id[b] >= 0 && id[b] < vocab, "VQModelStep (native): token id ", id[b], " is not in [0, ", vocab, ")");
  }
  at::Tensor x = at::empty({B, d}, embed_.options());
  at::Tensor y = at::empty({B, d}, embed_.options());
  at::Tensor commit = at::empty({}, embed_.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "VQModelStep", [&] {
    scalar_t* rows = x.data_ptr<scalar_t>();
    const scalar_t* table = embed_.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) std::copy_n(table + id[b] * d, d, rows + b * d);
    for (int64_t u = 0; u < n; ++u) {
      const Unit& unit = units_[u];
      TORCH_CHECK(unit.window.size() == 4, "VQModelStep (native): unit ", u, " has no buffer (set_window)");
      const std::vector<at::Tensor>& c = unit.constants;
      vq_gau_step(x, c[0], unit.input_shift, unit.eps, c[1], c[2], c[3], c[4], c[5], c[6], c[7], unit.window[0],
                  unit.window[1], unit.window[2], unit.window[3], block_size_, p, unit.keys_are_codes, 0.0, y,
                  codes[u], commit);
      const scalar_t* added = y.data_ptr<scalar_t>();
      for (int64_t i = 0; i < B * d; ++i) rows[i] += added[i];
    }
    const scalar_t* gain = norm_weight_.data_ptr<scalar_t>();
    for (int64_t b = 0; b < B; ++b) {
      scalar_t* row = rows + b * d;
      scalar_t sum = 0;
      for (int64_t i = 0; i < d; ++i) sum += row[i] * row[i];
      const scalar_t r = scalar_t(1) / std::sqrt(sum / static_cast<scalar_t>(d) + static_cast<scalar_t>(norm_eps_));
      for (int64_t i = 0; i < d; ++i) row[i] = row[i] * r * gain[i];
    }
    const int64_t V = head_t_.size(1);
    scalar_t* out = logits.data_ptr<scalar_t>();
    rows_times(static_cast<const scalar_t*>(rows), B, d, head_t_.data_ptr<scalar_t>(), V,
               static_cast<const scalar_t*>(nullptr), out);
    if (greedy.has_value()) {
      int64_t* tokens = greedy->data_ptr<int64_t>();
      for (int64_t b = 0; b < B; ++b) {
        const scalar_t* row = out + b * V;
        int64_t best = 0;
        for (int64_t j = 0; j < V && best >= 0; ++j) {
          if (!std::isfinite(row[j])) best = -1;
          else if (row[j] > row[best]) best = j;
        }
        tokens[b] = best;
      }
    }
  });
}

}  // namespace linattn
