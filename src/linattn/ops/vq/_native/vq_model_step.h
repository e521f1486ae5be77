// One generated token through a whole Transformer-VQ language model in one call
// (vq_model_step.cpp; models/_vq_generation.py holds it for LM.generate).
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace linattn {

class VQModelStep {
 public:
  // embed [V, d]; the final RMSNorm's gain [d] and eps; head_t [d, V] (the tied embedding's
  // transpose or the head's weight's); L the block size.
  VQModelStep(at::Tensor embed, at::Tensor norm_weight, double norm_eps, at::Tensor head_t, int64_t block_size);

  // The next gated attention unit's constants, in the order the units run: input_t,
  // content_bias, position_keys_reversed_t, bias_reversed, output_t, search_t, norms,
  // codebook_t (as vq_gau_step takes them), its ReRoPE window (0: none) and frequencies, and its
  // finite scalar quantizer's tensors (empty: the nearest-code search), soft VQ's temperature (0: hard).
  void add_unit(std::vector<at::Tensor> constants, const c10::optional<at::Tensor>& input_shift, double eps,
                int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies, std::vector<at::Tensor> fsq,
                double soft_temperature);

  // The resident buffer unit `unit` reads and writes (vq_decode_step's keys, values, codes, mask).
  void set_window(int64_t unit, at::Tensor keys, at::Tensor values, at::Tensor codes, at::Tensor mask,
                  bool keys_are_codes);

  // ids [B] int64 at position p of the current block -> logits [B, V]; codes [units, B, 1]
  // receives each unit's new code; greedy [B] int64, when given, each row's argmax (the first
  // largest logit, as torch.argmax), or -1 where a logit of the row is not finite.
  void step(const at::Tensor& ids, int64_t p, at::Tensor logits, at::Tensor codes,
            const c10::optional<at::Tensor>& greedy);

  int64_t units() const { return static_cast<int64_t>(units_.size()); }

 private:
  struct Unit {
    std::vector<at::Tensor> constants;
    c10::optional<at::Tensor> input_shift;
    double eps;
    int64_t rerope;  // ReRoPE's w (0: off), with its rerope_frequencies
    c10::optional<at::Tensor> rerope_frequencies;
    std::vector<at::Tensor> fsq;
    double soft_temperature;
    std::vector<at::Tensor> window;  // keys, values, codes, mask
    bool keys_are_codes = false;
  };
  at::Tensor embed_, norm_weight_, head_t_;
  double norm_eps_;
  int64_t block_size_;
  std::vector<Unit> units_;
};

}  // namespace linattn
