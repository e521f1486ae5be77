// One generated token through a whole language model of pre-norm blocks in one call
// (block_model_step.cpp; models/_block_generation.py holds it for LM.generate).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

namespace linattn {

class BlockModelStep {
 public:
  // embed [V, d]; the final RMSNorm's gain [d] and eps; head_t [d, V] (the tied embedding's
  // transpose or the head's weight's).
  BlockModelStep(at::Tensor embed, at::Tensor norm_weight, double norm_eps, at::Tensor head_t);

  // The next block, in the order the blocks run: its mixer ("sum", "delta", "softmax" or
  // "local", the rules of block_model_step.cpp), its tensors and numbers by the names listed there.
  void add_block(const std::string& mixer, const std::map<std::string, at::Tensor>& tensors,
                 const std::map<std::string, double>& numbers);

  // The state tensors block `block` reads and writes in place: "memory", and "normalizer",
  // "conv" where its mixer has them; "keys" and "values" for the softmax mixers, whose first
  // `length` rows hold the cache (softmax), or a ring of the last window - 1 positions (local).
  void set_state(int64_t block, const std::map<std::string, at::Tensor>& state, int64_t length);

  // The rows of block `block`'s softmax cache (its `length` after the tokens stepped so far).
  int64_t cache_length(int64_t block) const;

  // ids [B] int64 at sequence position `position` (the tokens before it) -> logits [B, V];
  // greedy [B] int64, when given, each row's argmax (-1 where a logit is not finite).
  void step(const at::Tensor& ids, int64_t position, at::Tensor logits, const c10::optional<at::Tensor>& greedy);

  int64_t blocks() const { return static_cast<int64_t>(blocks_.size()); }

  struct Block;

 private:
  at::Tensor embed_, norm_weight_, head_t_;
  double norm_eps_;
  std::vector<Block> blocks_;
};

// How a block's mixer turns its projections into heads' outputs, and its state.
struct BlockModelStep::Block {
  bool delta = false;  // the delta rule's write; else the sum rule's
  int64_t softmax = 0;  // 1: softmax over a cache of every position; 2: over a window; 0: neither
  int64_t window = 0, length = 0;
  bool entropy = false;
  at::Tensor in_t, in_bias, out_t, out_bias, gate_up_t, down_t;
  double mixer_eps = 0, ffn_eps = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  int64_t feature = 0, normalize = 0;  // the codes of block_model_step.cpp
  double feature_eps = 0, scale = 1;
  at::Tensor frequencies;  // [D/2]: rotary q and k (undefined: none)
  at::Tensor conv_weight, conv_bias;  // [C, K], [C]
  int64_t conv_kernel = 0;
  bool silu_qkv = false, beta = false, gate = false;
  int64_t decay = 0, rank = 0;
  at::Tensor log_decay, decay_rate, dt_bias, decay_up_t, decay_bias;
  double temperature = 1;
  int64_t head_norm = 0;
  at::Tensor head_gain, head_bias;
  double head_eps = 0;
  at::Tensor memory, normalizer, conv, keys, values;  // the state
};

}  // namespace linattn
