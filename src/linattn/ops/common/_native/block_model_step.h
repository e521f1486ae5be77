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
  static constexpr const char* kWhat = "BlockModelStep (native)";  // what its errors name

  // embed [V, d]; the final RMSNorm's gain [d] and eps; head_t [d, V] (the tied embedding's
  // transpose or the head's weight's).
  BlockModelStep(at::Tensor embed, at::Tensor norm_weight, double norm_eps, at::Tensor head_t);

  // The next block, in the order the blocks run: its mixer ("sum", "delta", "softmax", "local"
  // or "vq", the rules of block_model_step.cpp), its tensors and numbers by the names listed there.
  void add_block(const std::string& mixer, const std::map<std::string, at::Tensor>& tensors,
                 const std::map<std::string, double>& numbers);

  // The state tensors block `block` reads and writes in place: "memory", and "normalizer",
  // "shift" (an exponential map's running key shift), "conv" where its mixer has them; "keys" and "values" for the softmax mixers, whose first
  // `length` rows hold the cache (softmax), or a ring of the last window - 1 positions (local).
  void set_state(int64_t block, const std::map<std::string, at::Tensor>& state, int64_t length);

  // The rows of block `block`'s softmax cache (its `length` after the tokens stepped so far).
  int64_t cache_length(int64_t block) const;

  // A Transformer-VQ gated attention unit as the next block: x <- x + unit(x) (its own pre-norm,
  // no feed-forward), by vq_gau_step; its constants, ReRoPE, FSQ tensors and soft temperature as
  // VQModelStep::add_unit takes them, L its block size.
  void add_vq_unit(std::vector<at::Tensor> constants, const c10::optional<at::Tensor>& input_shift, double eps,
                   int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies, std::vector<at::Tensor> fsq,
                   double soft_temperature, int64_t block_size);

  // A gated attention unit with exact softmax (GAU(attention="softmax")) as the next block: x <- x +
  // unit(x), by gau_softmax_step; its constants input_t, content_bias, position_keys_reversed_t,
  // bias_reversed, output_t, input shift and eps, the entropy scale, L its block size. Its cache is
  // set_state's "keys" [B, 1, rows, d_k] and "values" [B, 1, rows, d_v], the first `length` rows held.
  void add_softmax_unit(std::vector<at::Tensor> constants, const c10::optional<at::Tensor>& input_shift, double eps,
                        bool entropy, int64_t block_size);

  // The resident buffer the VQ unit or multi-head VQ attention `block` reads and writes
  // (vq_decode_step's keys, values, codes, mask).
  void set_window(int64_t block, at::Tensor keys, at::Tensor values, at::Tensor codes, at::Tensor mask,
                  bool keys_are_codes);

  // ids [B] int64 at sequence position `position` (the tokens before it) -> logits [B, V];
  // greedy [B] int64, when given, each row's argmax (-1 where a logit is not finite);
  // vq_position, the position of the token in the current block of every VQ unit and VQ attention.
  void step(const at::Tensor& ids, int64_t position, at::Tensor logits, const c10::optional<at::Tensor>& greedy,
            int64_t vq_position);

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
  int64_t window = 0, length = 0, rerope = 0;  // rerope: ReRoPE's w (0: off)
  at::Tensor rerope_frequencies;  // [D/2], ReRoPE's (the keys unrotated)
  bool entropy = false;
  at::Tensor in_t, in_bias, out_t, out_bias, gate_up_t, down_t;
  double mixer_eps = 0, ffn_eps = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, ffn = 0;
  int64_t feature = 0, normalize = 0;  // the codes of block_model_step.cpp
  int64_t feature_width = 0, dpfp_nu = 0;  // F, the features of a head; DPFP's nu (feature 4)
  at::Tensor query_map, key_map;  // Hedgehog's maps [H, D, D], [Hkv, D, D] (feature 3)
  at::Tensor projection_t;  // FAVOR+'s projection, transposed: [D, F] (feature 7)
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
  at::Tensor memory, normalizer, shift, conv, keys, values;  // the state
  // Multi-head VQ attention (the "vq" mixer): the codebook as vq_decode_step reads it (search_t
  // [Hkv, D, S] and norms [Hkv, S] in float32, codebook_t [Hkv, D, S]), the windowed bias reversed
  // (relative [Hkv, G, L + 1], undefined: none); its block size, rerope and buffer are the unit's below.
  bool vq_heads = false;
  at::Tensor search_t, norms, codebook_t, relative;
  // A VQ gated attention unit (add_vq_unit): its constants, input shift, eps and block size, its
  // resident buffer (keys, values, codes, mask) and whether every key there is a code.
  bool vq = false;
  bool softmax_unit = false;  // a gated attention unit with exact softmax (add_softmax_unit; softmax 1)
  int64_t value_dim = 0;  // the values' width where it is not head_dim (a softmax unit's d_v)
  std::vector<at::Tensor> vq_constants, vq_window, fsq;
  c10::optional<at::Tensor> input_shift;
  double vq_eps = 0, soft_temperature = 0;
  int64_t vq_block = 0;
  bool keys_are_codes = false;
};

// The columns of a mixer's input product p (block_model_step.cpp): q | k | v | gate | beta | decay's input.
struct Columns {
  int64_t q, k, v, gate, beta, decay, width;
};

inline Columns columns(const BlockModelStep::Block& block) {
  const int64_t H = block.heads, Hkv = block.kv_heads, D = block.head_dim;
  Columns c{};
  c.q = 0;
  c.k = H * D;
  c.v = c.k + Hkv * D;
  c.gate = c.v + Hkv * D;
  c.beta = c.gate + (block.gate ? H * D : 0);
  c.decay = c.beta + (block.beta ? Hkv : 0);
  c.width = c.decay + (block.decay == 2 ? Hkv : (block.decay == 3 ? block.rank : 0));
  return c;
}

// Whether the block's feature map is exponential (feature 6 or 7): log-features, and with
// "normalize" 1 a running key shift.
inline bool exponential(const BlockModelStep::Block& block) { return block.feature == 6 || block.feature == 7; }

}  // namespace linattn
