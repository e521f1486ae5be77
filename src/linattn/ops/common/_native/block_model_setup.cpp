// Building the whole-model step of block_model_step.cpp: the model's ends, each block's tensors
// and numbers (checked by name, shape and dtype as they enter), the units, states and buffers.
#include <ATen/ATen.h>

#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "block_model_step.h"
#include "native_checks.h"

namespace linattn {

namespace {

constexpr const char* kWhat = BlockModelStep::kWhat;

const at::Tensor& tensor(const std::map<std::string, at::Tensor>& tensors, const char* name) {
  auto found = tensors.find(name);
  TORCH_CHECK(found != tensors.end(), kWhat, ": the block has no tensor '", name, "'");
  return found->second;
}

at::Tensor optional_tensor(const std::map<std::string, at::Tensor>& tensors, const char* name) {
  auto found = tensors.find(name);
  return found == tensors.end() ? at::Tensor() : found->second;
}

double number(const std::map<std::string, double>& numbers, const char* name, double otherwise) {
  auto found = numbers.find(name);
  return found == numbers.end() ? otherwise : found->second;
}

double number(const std::map<std::string, double>& numbers, const char* name) {
  auto found = numbers.find(name);
  TORCH_CHECK(found != numbers.end(), kWhat, ": the block has no number '", name, "'");
  return found->second;
}

int64_t count(const std::map<std::string, double>& numbers, const char* name, int64_t low, int64_t high) {
  const double value = number(numbers, name, 0.0);
  TORCH_CHECK(value == std::floor(value) && value >= low && value <= high, kWhat, ": '", name, "' must be an integer in [",
              low, ", ", high, "], got ", value);
  return static_cast<int64_t>(value);
}

}  // namespace

BlockModelStep::BlockModelStep(at::Tensor embed, at::Tensor norm_weight, double norm_eps, at::Tensor head_t)
    : embed_(std::move(embed)), norm_weight_(std::move(norm_weight)), head_t_(std::move(head_t)),
      norm_eps_(norm_eps) {
  TORCH_CHECK(embed_.dim() == 2 && head_t_.dim() == 2, kWhat, ": embed [V, d], head_t [d, V']");
  TORCH_CHECK(embed_.scalar_type() == at::kFloat || embed_.scalar_type() == at::kDouble, kWhat,
              ": the model's dtype must be float32 or float64");
  const auto type = embed_.scalar_type();
  const int64_t d = embed_.size(1);
  linattn_native::check_tensor(kWhat, embed_, "embed", type, {embed_.size(0), d});
  linattn_native::check_tensor(kWhat, norm_weight_, "norm_weight", type, {d});
  linattn_native::check_tensor(kWhat, head_t_, "head_t", type, {d, head_t_.size(1)});
}

void BlockModelStep::add_block(const std::string& mixer, const std::map<std::string, at::Tensor>& tensors,
                               const std::map<std::string, double>& numbers) {
  TORCH_CHECK(mixer == "sum" || mixer == "delta" || mixer == "softmax" || mixer == "local" || mixer == "vq", kWhat,
              ": a block's mixer is 'sum', 'delta', 'softmax', 'local' or 'vq', got '", mixer, "'");
  const auto type = embed_.scalar_type();
  const int64_t d = embed_.size(1);
  const auto check = [&](const at::Tensor& t, const char* name, at::IntArrayRef shape) {
    linattn_native::check_tensor(kWhat, t, name, type, shape);
  };
  Block block;
  block.delta = mixer == "delta";
  block.softmax = mixer == "softmax" ? 1 : (mixer == "local" ? 2 : 0);
  block.window = block.softmax == 2 ? count(numbers, "window", 1, int64_t(1) << 40) : 0;
  block.entropy = count(numbers, "entropy", 0, 1) == 1;
  block.vq_heads = mixer == "vq";
  block.vq_block = block.vq_heads ? count(numbers, "block_size", 1, int64_t(1) << 40) : 0;
  block.rerope = block.softmax > 0 || block.vq_heads
                     ? count(numbers, "rerope", 0, block.vq_heads ? block.vq_block : int64_t(1) << 40)
                     : 0;
  block.heads = count(numbers, "heads", 1, 1 << 20);
  block.kv_heads = count(numbers, "kv_heads", 1, block.heads);
  block.head_dim = count(numbers, "head_dim", 1, 1 << 20);
  TORCH_CHECK(block.heads % block.kv_heads == 0, kWhat, ": kv_heads must divide heads");
  const int64_t H = block.heads, Hkv = block.kv_heads, D = block.head_dim;
  block.feature = count(numbers, "feature", 0, 7);
  block.dpfp_nu = block.feature == 4 ? count(numbers, "dpfp_nu", 1, 1 << 10) : 0;
  block.feature_width = block.feature == 3   ? 2 * D
                        : block.feature == 4 ? 2 * D * block.dpfp_nu
                        : block.feature == 5 ? 1 + D + D * D
                        : block.feature == 7 ? count(numbers, "favor_features", 1, 1 << 20)
                                             : D;
  block.normalize = count(numbers, "normalize", 0, 3);
  TORCH_CHECK(!exponential(block) || block.normalize == 1 || block.normalize == 2, kWhat,
              ": an exponential map (feature 6 or 7) is normalised by the denominator (1) or by its sum (2)");
  TORCH_CHECK(!(block.delta && block.normalize == 1), kWhat, ": the delta rule has no denominator (normalize 1)");
  block.feature_eps = number(numbers, "feature_eps");
  block.scale = number(numbers, "scale");
  block.mixer_eps = number(numbers, "mixer_eps");
  block.ffn_eps = number(numbers, "ffn_eps");
  block.gate = count(numbers, "gate", 0, 1) == 1;
  block.beta = count(numbers, "beta", 0, 1) == 1;
  block.silu_qkv = count(numbers, "silu_qkv", 0, 1) == 1;
  block.conv_kernel = count(numbers, "conv_kernel", 0, 1 << 10);
  block.decay = count(numbers, "decay", 0, 3);
  block.rank = block.decay == 3 ? count(numbers, "rank", 1, 1 << 20) : 0;
  block.temperature = number(numbers, "temperature", 1.0);
  block.head_norm = count(numbers, "head_norm", 0, 2);
  block.head_eps = number(numbers, "head_eps", 0.0);
  TORCH_CHECK(block.decay == 0 || block.feature_width == D, kWhat, ": a decay is per key channel of the head (",
              D, "), the features are ", block.feature_width, " wide");
  const Columns c = columns(block);
  block.in_t = tensor(tensors, "in_t");
  check(block.in_t, "in_t", {d, c.width});
  block.in_bias = optional_tensor(tensors, "in_bias");
  if (block.in_bias.defined()) check(block.in_bias, "in_bias", {c.width});
  block.out_t = tensor(tensors, "out_t");
  check(block.out_t, "out_t", {H * D, d});
  block.out_bias = optional_tensor(tensors, "out_bias");
  if (block.out_bias.defined()) check(block.out_bias, "out_bias", {d});
  block.gate_up_t = tensor(tensors, "gate_up_t");
  TORCH_CHECK(block.gate_up_t.dim() == 2 && block.gate_up_t.size(1) % 2 == 0, kWhat, ": gate_up_t is [d, 2 F]");
  block.ffn = block.gate_up_t.size(1) / 2;
  check(block.gate_up_t, "gate_up_t", {d, 2 * block.ffn});
  block.down_t = tensor(tensors, "down_t");
  check(block.down_t, "down_t", {block.ffn, d});
  block.frequencies = optional_tensor(tensors, "frequencies");
  if (block.frequencies.defined()) {
    TORCH_CHECK(D % 2 == 0, kWhat, ": rotary positions need an even head_dim");
    check(block.frequencies, "frequencies", {D / 2});
  }
  if (block.rerope > 0) {  // the keys stay unrotated: the softmax turns each query by its distance
    TORCH_CHECK(!block.frequencies.defined(), kWhat, ": ReRoPE turns q in the softmax; the block has no frequencies");
    TORCH_CHECK(D % 2 == 0, kWhat, ": ReRoPE needs an even head_dim");
    block.rerope_frequencies = tensor(tensors, "rerope_frequencies");
    check(block.rerope_frequencies, "rerope_frequencies", {D / 2});
  }
  if (block.conv_kernel > 0) {
    block.conv_weight = tensor(tensors, "conv_weight");
    block.conv_bias = tensor(tensors, "conv_bias");
    check(block.conv_weight, "conv_weight", {c.gate, block.conv_kernel});
    check(block.conv_bias, "conv_bias", {c.gate});
  }
  if (block.feature == 7) {
    block.projection_t = tensor(tensors, "projection_t");
    check(block.projection_t, "projection_t", {D, block.feature_width});
  }
  if (block.feature == 3) {
    block.query_map = tensor(tensors, "query_map");
    block.key_map = tensor(tensors, "key_map");
    check(block.query_map, "query_map", {H, D, D});
    check(block.key_map, "key_map", {Hkv, D, D});
  }
  if (block.decay == 1) {
    block.log_decay = tensor(tensors, "log_decay");
    check(block.log_decay, "log_decay", {Hkv});
  } else if (block.decay == 2) {
    block.decay_rate = tensor(tensors, "decay_rate");
    block.dt_bias = tensor(tensors, "dt_bias");
    check(block.decay_rate, "decay_rate", {Hkv});
    check(block.dt_bias, "dt_bias", {Hkv});
  } else if (block.decay == 3) {
    block.decay_up_t = tensor(tensors, "decay_up_t");
    block.decay_bias = tensor(tensors, "decay_bias");
    check(block.decay_up_t, "decay_up_t", {block.rank, Hkv * D});
    check(block.decay_bias, "decay_bias", {Hkv * D});
  }
  if (block.head_norm > 0) {
    block.head_gain = tensor(tensors, "head_gain");
    check(block.head_gain, "head_gain", {block.head_norm == 1 ? D : H * D});
  }
  if (block.head_norm == 2) {
    block.head_bias = tensor(tensors, "head_bias");
    check(block.head_bias, "head_bias", {H * D});
  }
  if (block.vq_heads) {
    TORCH_CHECK(block.feature == 0 && block.normalize == 0 && !block.gate && !block.beta && block.decay == 0 &&
                    block.conv_kernel == 0 && !block.silu_qkv && block.head_norm == 0 && !block.frequencies.defined(),
                kWhat, ": a 'vq' mixer reads q, k and v only (no map, gate, beta, decay, convolution, head norm "
                "or rotary frequencies)");
    block.search_t = tensor(tensors, "search_t");
    TORCH_CHECK(block.search_t.dim() == 3, kWhat, ": search_t is [Hkv, D, S]");
    const int64_t S = block.search_t.size(2);
    linattn_native::check_tensor(kWhat, block.search_t, "search_t", at::kFloat, {Hkv, D, S});
    block.norms = tensor(tensors, "norms");
    linattn_native::check_tensor(kWhat, block.norms, "norms", at::kFloat, {Hkv, S});
    block.codebook_t = tensor(tensors, "codebook_t");
    check(block.codebook_t, "codebook_t", {Hkv, D, S});
    block.relative = optional_tensor(tensors, "relative");
    if (block.relative.defined()) check(block.relative, "relative", {Hkv, H / Hkv, block.vq_block + 1});
  }
  blocks_.push_back(std::move(block));
}

void BlockModelStep::set_state(int64_t index, const std::map<std::string, at::Tensor>& state, int64_t length) {
  TORCH_CHECK(index >= 0 && index < blocks() && !blocks_[index].vq && !blocks_[index].vq_heads, kWhat, ": no block ",
              index, " of a mixer's state (a VQ block's is set_window's)");
  Block& block = blocks_[index];
  const auto type = embed_.scalar_type();
  const int64_t Hkv = block.kv_heads, D = block.head_dim;
  if (block.softmax > 0) {
    block.keys = tensor(state, "keys");
    block.values = tensor(state, "values");
    TORCH_CHECK(block.keys.dim() == 4, kWhat, ": keys is [B, Hkv, rows, D]");
    const int64_t B = block.keys.size(0), rows = block.keys.size(2);
    TORCH_CHECK(block.softmax == 1 || rows == block.window - 1, kWhat, ": a local cache holds window - 1 = ",
                block.window - 1, " rows, got ", rows);
    TORCH_CHECK(block.softmax == 2 || (length >= 0 && length <= rows), kWhat, ": length ", length,
                " is not in [0, ", rows, "]");
    linattn_native::check_tensor(kWhat, block.keys, "keys", type, {B, Hkv, rows, D});
    linattn_native::check_tensor(kWhat, block.values, "values", type,
                                 {B, Hkv, rows, block.value_dim > 0 ? block.value_dim : D});
    block.length = length;
    return;
  }
  const int64_t F = block.feature_width;
  block.memory = tensor(state, "memory");
  TORCH_CHECK(block.memory.dim() == 4, kWhat, ": memory is [B, Hkv, F, D]");
  const int64_t B = block.memory.size(0);
  linattn_native::check_tensor(kWhat, block.memory, "memory", type, {B, Hkv, F, D});
  block.normalizer = block.normalize == 1 ? tensor(state, "normalizer") : at::Tensor();
  if (block.normalizer.defined()) linattn_native::check_tensor(kWhat, block.normalizer, "normalizer", type, {B, Hkv, F});
  block.shift = exponential(block) && block.normalize == 1 ? tensor(state, "shift") : at::Tensor();
  if (block.shift.defined()) linattn_native::check_tensor(kWhat, block.shift, "shift", type, {B, Hkv});
  block.conv = block.conv_kernel > 1 ? tensor(state, "conv") : at::Tensor();
  if (block.conv.defined()) {
    linattn_native::check_tensor(kWhat, block.conv, "conv", type, {B, columns(block).gate, block.conv_kernel - 1});
  }
}

void BlockModelStep::add_vq_unit(std::vector<at::Tensor> constants, const c10::optional<at::Tensor>& input_shift,
                                 double eps, int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
                                 std::vector<at::Tensor> fsq, double soft_temperature, int64_t block_size) {
  TORCH_CHECK(constants.size() == 8, kWhat, ": a VQ unit has 8 constants, got ", constants.size());
  TORCH_CHECK(block_size >= 1, kWhat, ": a VQ unit's block size must be positive, got ", block_size);
  Block block;
  block.vq = true;
  block.vq_constants = std::move(constants);
  block.input_shift = input_shift;
  block.vq_eps = eps;
  block.vq_block = block_size;
  block.rerope = rerope;
  if (rerope_frequencies.has_value()) block.rerope_frequencies = *rerope_frequencies;
  block.fsq = std::move(fsq);
  block.soft_temperature = soft_temperature;
  blocks_.push_back(std::move(block));
}

void BlockModelStep::add_softmax_unit(std::vector<at::Tensor> constants, const c10::optional<at::Tensor>& input_shift,
                                      double eps, bool entropy, int64_t block_size) {
  TORCH_CHECK(constants.size() == 5 && constants[2].dim() == 2 && constants[4].dim() == 2, kWhat,
              ": a softmax unit has 5 constants (input_t, content_bias, position_keys_reversed_t [d_k, L + 1], "
              "bias_reversed, output_t [d_v, d])");
  TORCH_CHECK(block_size >= 1, kWhat, ": a softmax unit's block size must be positive, got ", block_size);
  Block block;
  block.softmax_unit = true;
  block.softmax = 1;
  block.kv_heads = 1;
  block.head_dim = constants[2].size(0);
  block.value_dim = constants[4].size(0);
  block.entropy = entropy;
  block.vq_constants = std::move(constants);
  block.input_shift = input_shift;
  block.vq_eps = eps;
  block.vq_block = block_size;
  blocks_.push_back(std::move(block));
}

void BlockModelStep::set_window(int64_t index, at::Tensor keys, at::Tensor values, at::Tensor codes, at::Tensor mask,
                                bool keys_are_codes) {
  TORCH_CHECK(index >= 0 && index < blocks() && (blocks_[index].vq || blocks_[index].vq_heads), kWhat, ": block ",
              index, " is not a VQ unit or multi-head VQ attention");
  blocks_[index].vq_window = {std::move(keys), std::move(values), std::move(codes), std::move(mask)};
  blocks_[index].keys_are_codes = keys_are_codes;
}

int64_t BlockModelStep::cache_length(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < blocks(), kWhat, ": no block ", index);
  return blocks_[index].length;
}

}  // namespace linattn
