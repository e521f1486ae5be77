// One generated token through a whole language model of pre-norm blocks (models/layers.py's
// PreNormBlock) in one call, for CPU tensors in float32 or float64:
//
//   x       = E[ids]                                                          [B, d]
//   x       = x + W_o mixer(RMSNorm(x)) (+ b_o)    for every block, in order
//   x       = x + W_down (SiLU(W_gate h) * W_up h),  h = RMSNorm(x)
//             (a Transformer-VQ gated attention unit among the blocks: x = x + unit(x), vq_gau_step.cpp;
//             a unit with exact softmax likewise, gau_softmax_step)
//   logits  = RMSNorm(x) H^T,  and the argmax when asked (lm_ends.h)
//
// The norms' gains are folded into the matrices after them (`in_t`, `gate_up_t`): with
// r = 1 / sqrt(mean(x^2) + eps), RMSNorm(x) W^T = r (x (W diag(g))^T).
//
// A mixer reads one product of its input, p = r (x in_t) (+ in_bias), whose columns are
// q [H D] | k [Hkv D] | v [Hkv D] | the gate [H D] | beta [Hkv] | the decay's input ([Hkv] or
// [rank]), each part present where the block's numbers say so. Then, in order:
//
//   q, k, v   <- SiLU(b + sum_{i<K} w_i [cache, p]_i)   causal depthwise convolution ("conv_kernel" K;
//                the state "conv" [B, C, K-1] holds the last K-1 inputs), or SiLU(q, k, v) ("silu_qkv")
//   q, k      <- rotated at `position` (pairs (2m, 2m+1) by position * f_m, "frequencies" [D/2])
//   beta      = sigmoid(p_beta)  ("beta"; else 1)
//   a         = exp(g): "decay" 1: g = log_decay [Hkv] (fixed, per kv head); 2: g = -decay_rate
//               softplus(p_decay + dt_bias) (Mamba-2, per kv head); 3: g = logsigmoid(p_decay
//               decay_up_t + decay_bias) / temperature (per key channel, low rank: GLA); 0: a = 1
//   phi       = "feature" 0: x, 1: elu(x) + 1, 2: max(x, 0) (F = D features); 3: Hedgehog's
//               [softmax(x W_h), softmax(-x W_h)] with W_h the head's [D, D] map of "query_map"
//               [H, D, D] or "key_map" [Hkv, D, D] (F = 2 D); 4: DPFP, r = [max(x, 0), max(-x, 0)],
//               then r * roll(r, i) for i = 1 .. "dpfp_nu" side by side (F = 2 D nu); 5: Taylor's
//               [1, x / D^(1/4), vec(x x^T) / (sqrt(2) sqrt(D))] (F = 1 + D + D^2); then "normalize"
//               2: phi / (sum phi + eps), 3: phi / max(|phi|, eps) (eps "feature_eps").
//               The exponential maps give log-features l: 6: l = x (F = D); 7: FAVOR+, with x' = x D^-1/4
//               and the "projection_t" W^T [D, F], l = W x' - |x'|^2 / 2 - log(F) / 2; phi = exp(l), under
//               "normalize" 2 as softmax(l), under 1 shifted as below
//
// and per key/value head, with S = "memory" [B, Hkv, F, D] (rows: key features) and z =
// "normalizer" [B, Hkv, F]:
//
//   sum rule:    S <- diag(a) S + phi(k) v^T,  z <- a z + phi(k);  for each query head of the group,
//                o = S^T phi(scale q) (/ (phi(scale q).z + eps) with "normalize" 1). An exponential
//                map under "normalize" 1 keeps S and z scaled by exp(-c), c the row's running key shift
//                ("shift" [B, Hkv]): c' = max(c, max_f l(k)), S and z times exp(c - c'), phi(k) =
//                exp(l(k) - c'); a query's phi(q) = exp(l(q) - m), m = max_f l(q), and o = S^T phi(q) /
//                (phi(q).z + eps exp(-(m + c'))): the shifts cancel in the ratio
//   delta rule:  S' = diag(a) S,  u = beta (v - S'^T phi(k)),  S <- S' + phi(k) u^T,  o = scale S^T phi(q)
//
// The softmax mixers ("softmax", "local") keep keys and values instead, "keys", "values"
// [B, Hkv, rows, D] (after the rotation): "softmax" writes the new ones at row `length` of a
// preallocated cache and each query head reads rows 0 .. length; "local" ("window" W) reads the
// ring of the last W - 1 positions (position i at row i mod (W - 1)) and the new key, then writes
// the new key over the oldest. With a = scale q (or, "entropy", q log(n) / log(512) / sqrt(D), n
// the keys it reads): o = sum_j exp(a.k_j - m) v_j / sum_j exp(a.k_j - m), m = max_j a.k_j; with
// ReRoPE ("rerope" w, "rerope_frequencies" [D/2]) the keys are kept unrotated and a.k_j is
// (R(min(d_j, w)) a).k_j, d_j the key's distance from the query.
//
// The "vq" mixer (multi-head VQ attention) quantizes each key/value head's key to its codebook and
// attends over the head's resident buffer (set_window; block "block_size" L, the token at
// `vq_position` in its block) by vq_decode_step.cpp, with "scale", ReRoPE ("rerope" w <= L,
// "rerope_frequencies") or the windowed bias reversed ("relative" [Hkv, G, L + 1]).
//
// then per query head "head_norm" 1: o / sqrt(mean(o^2) + eps) * head_gain [D]; 2: (o - mean(o)) /
// sqrt(var(o) + eps) * head_gain [H D] + head_bias [H D] (eps "head_eps"); then o * SiLU(p_gate)
// ("gate"). The recurrences of the (batch, kv head) rows are spread over the intra-op threads,
// one row per task, and the products add in a fixed order (row_products.h): nothing depends
// on the thread count.
#include "block_model_step.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "block_features.h"
#include "fast_exp.h"
#include "lane_dot.h"
#include "lm_ends.h"
#include "native_checks.h"
#include "rotation.h"
#include "row_products.h"
#include "vq_kernels.h"

namespace linattn {

namespace {

constexpr const char* kWhat = BlockModelStep::kWhat;

template <typename T>
T silu(T x) {
  return x / (T(1) + std::exp(-x));
}

template <typename T>
T sigmoid(T x) {
  return T(1) / (T(1) + std::exp(-x));
}

template <typename T>
T softplus(T x) {  // torch's, threshold 20
  return x > T(20) ? x : std::log1p(std::exp(x));
}

template <typename T>
T log_sigmoid(T x) {
  return std::min(x, T(0)) - std::log1p(std::exp(-std::abs(x)));
}

// The sum or delta rule of every (batch, kv head) row, one row per task -> o [B, H D].
template <typename T>
void recur(BlockModelStep::Block& block, const T* p, int64_t P, const Columns& c, const T* a, const T* beta,
           int64_t B, T* o) {
  const int64_t H = block.heads, Hkv = block.kv_heads, D = block.head_dim, G = H / Hkv, F = block.feature_width;
  T* memory = block.memory.data_ptr<T>();
  T* normalizer = block.normalize == 1 ? block.normalizer.data_ptr<T>() : nullptr;
  const T* query_maps = block.query_map.defined() ? block.query_map.data_ptr<T>() : nullptr;
  const T* key_maps = block.key_map.defined() ? block.key_map.data_ptr<T>() : nullptr;
  const T eps = static_cast<T>(block.feature_eps), scale = static_cast<T>(block.scale);
  const bool shifted = exponential(block) && block.normalize == 1;
  T* shifts = shifted ? block.shift.data_ptr<T>() : nullptr;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, F * D * (G + 2)));
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> key(F), query(F), scaled(D), scratch(2 * D), update(D);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / Hkv, j = n % Hkv;
      const T* row = p + b * P;
      const T* value = row + c.v + j * D;
      const T* decay = block.decay != 0 ? a + n * D : nullptr;  // per key channel (F = D)
      T* S = memory + n * F * D;
      if (shifted) {  // the row's shift grows to this key's largest log-feature
        log_features(block, row + c.k + j * D, key.data(), scratch.data());
        T top = -std::numeric_limits<T>::infinity();
        for (int64_t f = 0; f < F; ++f) top = std::max(top, key[f]);
        const T old = shifts[n], fresh = std::max(old, top), rescale = linattn_native::exp_of(old - fresh);
        for (int64_t i = 0; i < F * D; ++i) S[i] *= rescale;
        for (int64_t f = 0; f < F; ++f) normalizer[n * F + f] *= rescale;
        shifts[n] = fresh;
        for (int64_t f = 0; f < F; ++f) key[f] = linattn_native::exp_of(key[f] - fresh);
      } else {
        features(block, row + c.k + j * D, key_maps != nullptr ? key_maps + j * D * D : nullptr, key.data(),
                 scratch.data());
      }
      if (block.delta) {
        if (decay != nullptr) {
          for (int64_t f = 0; f < F; ++f) {
            for (int64_t e = 0; e < D; ++e) S[f * D + e] *= decay[f];
          }
        }
        std::fill(update.begin(), update.end(), T(0));
        for (int64_t f = 0; f < F; ++f) {
          for (int64_t e = 0; e < D; ++e) update[e] += key[f] * S[f * D + e];
        }
        for (int64_t e = 0; e < D; ++e) update[e] = beta[n] * (value[e] - update[e]);
        for (int64_t f = 0; f < F; ++f) {
          for (int64_t e = 0; e < D; ++e) S[f * D + e] += key[f] * update[e];
        }
      } else {
        for (int64_t f = 0; f < F; ++f) {
          const T kept = decay != nullptr ? decay[f] : T(1);
          for (int64_t e = 0; e < D; ++e) S[f * D + e] = kept * S[f * D + e] + key[f] * value[e];
        }
        if (normalizer != nullptr) {
          T* z = normalizer + n * F;
          for (int64_t f = 0; f < F; ++f) z[f] = (decay != nullptr ? decay[f] : T(1)) * z[f] + key[f];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = j * G + g;
        const T* q = row + c.q + h * D;
        if (!block.delta) {  // the sum rule's scale is on q, before the map
          for (int64_t i = 0; i < D; ++i) scaled[i] = q[i] * scale;
          q = scaled.data();
        }
        T stabilizer = eps;  // eps, shifted like the features for an exponential map
        if (shifted) {
          log_features(block, q, query.data(), scratch.data());
          T top = -std::numeric_limits<T>::infinity();
          for (int64_t f = 0; f < F; ++f) top = std::max(top, query[f]);
          for (int64_t f = 0; f < F; ++f) query[f] = linattn_native::exp_of(query[f] - top);
          stabilizer = static_cast<T>(static_cast<double>(eps) *
                                      std::exp(-(static_cast<double>(top) + static_cast<double>(shifts[n]))));
        } else {
          features(block, q, query_maps != nullptr ? query_maps + h * D * D : nullptr, query.data(), scratch.data());
        }
        T* out = o + (b * H + h) * D;
        std::fill_n(out, D, T(0));
        for (int64_t f = 0; f < F; ++f) {
          for (int64_t e = 0; e < D; ++e) out[e] += query[f] * S[f * D + e];
        }
        if (block.delta) {
          for (int64_t e = 0; e < D; ++e) out[e] *= scale;
        } else if (normalizer != nullptr) {
          const T* z = normalizer + n * F;
          T den = 0;
          for (int64_t f = 0; f < F; ++f) den += query[f] * z[f];
          for (int64_t e = 0; e < D; ++e) out[e] = out[e] / (den + stabilizer);
        }
      }
    }
  });
}

// Softmax attention of every (batch, kv head) row over its cache, one row per task -> o [B, H D];
// then the new keys and values enter the cache.
template <typename T>
void attend(BlockModelStep::Block& block, const T* p, int64_t P, const Columns& c, int64_t B, int64_t position,
            T* o) {
  const int64_t H = block.heads, Hkv = block.kv_heads, D = block.head_dim, G = H / Hkv;
  const int64_t rows = block.keys.size(2);
  const bool ring = block.softmax == 2;
  const int64_t t = block.length;
  TORCH_CHECK(ring || t < rows, kWhat, ": the softmax cache is full (", rows, " rows)");
  const int64_t cached = ring ? std::min(position, rows) : t;  // the keys read before the new one
  T* keys = block.keys.data_ptr<T>();
  T* values = block.values.data_ptr<T>();
  T scale = static_cast<T>(std::pow(static_cast<double>(D), -0.5));
  if (block.entropy) {
    scale = std::log(static_cast<T>(cached + 1)) / static_cast<T>(std::log(512.0)) / std::sqrt(static_cast<T>(D));
  }
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(1, (cached + 1) * D * G));
  // ReRoPE: key i at distance d_i from the query is scored by R(min(d_i, w)) q (keys unrotated)
  const int64_t w = block.rerope;
  const int64_t turns = w > 0 ? std::min(w, cached) + 1 : 0;  // the distances 0 .. min(w, cached) that occur
  const std::vector<T> cos_sin =  // R(d) for d = 0 .. turns - 1
      linattn_native::turn_table(w > 0 ? block.rerope_frequencies.data_ptr<T>() : static_cast<const T*>(nullptr), D,
                                 turns);
  const auto distance = [&](int64_t i) -> int64_t {  // of key i (row i, or the new key at i == cached)
    if (i == cached) return 0;
    return ring ? (((position - i - 1) % rows) + rows) % rows + 1 : cached - i;
  };
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<T> scores(cached + 1), query(D), turned(turns * D);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / Hkv, j = n % Hkv;
      const T* row = p + b * P;
      const T* key = row + c.k + j * D;
      const T* value = row + c.v + j * D;
      const T* K = keys + n * rows * D;
      const T* V = values + n * rows * D;
      if (!ring) {  // the new row first: the query reads rows 0 .. t
        std::copy_n(key, D, keys + (n * rows + t) * D);
        std::copy_n(value, D, values + (n * rows + t) * D);
      }
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = j * G + g;
        for (int64_t f = 0; f < D; ++f) query[f] = row[c.q + h * D + f] * scale;
        for (int64_t d = 0; d < turns; ++d) {  // R(d) q, the last one R(min(w, cached)) q
          std::copy_n(query.data(), D, turned.data() + d * D);
          linattn_native::turn(turned.data() + d * D, 1, D, cos_sin.data() + d * D);
        }
        T largest = -std::numeric_limits<T>::infinity();
        for (int64_t i = 0; i <= cached; ++i) {
          const T* k_i = ring && i == cached ? key : K + i * D;
          const T* q_i = w > 0 ? turned.data() + std::min(distance(i), turns - 1) * D : query.data();
          scores[i] = linattn_native::dot(q_i, k_i, D);
          largest = std::max(largest, scores[i]);
        }
        T total = 0;
        for (int64_t i = 0; i <= cached; ++i) {
          scores[i] = linattn_native::exp_of(scores[i] - largest);
          total += scores[i];
        }
        T* out = o + (b * H + h) * D;
        std::fill_n(out, D, T(0));
        for (int64_t i = 0; i <= cached; ++i) {
          const T* v_i = ring && i == cached ? value : V + i * D;
          const T weight = scores[i];
          for (int64_t e = 0; e < D; ++e) out[e] += weight * v_i[e];
        }
        for (int64_t e = 0; e < D; ++e) out[e] /= total;
      }
      if (ring && rows > 0) {  // the new key replaces the oldest
        std::copy_n(key, D, keys + (n * rows + position % rows) * D);
        std::copy_n(value, D, values + (n * rows + position % rows) * D);
      }
    }
  });
  if (!ring) block.length = t + 1;
}

// Multi-head VQ attention of every (batch, kv head) row over its resident buffer -> o [B, H D]
// (vq_decode_step.cpp, which also writes the new code, key and value into the buffer).
template <typename T>
void attend_vq(BlockModelStep::Block& block, const T* p, int64_t P, const Columns& c, int64_t B, int64_t vq_position,
               T* o) {
  const int64_t H = block.heads, Hkv = block.kv_heads, D = block.head_dim, G = H / Hkv;
  const auto options = block.in_t.options();
  at::Tensor q = at::empty({B, Hkv, G, D}, options), k = at::empty({B, Hkv, D}, options);
  at::Tensor v = at::empty({B, Hkv, D}, options), out = at::empty({B, Hkv, G, D}, options);
  at::Tensor codes = at::empty({B, Hkv}, options.dtype(at::kLong));
  for (int64_t b = 0; b < B; ++b) {
    const T* row = p + b * P;
    std::copy_n(row + c.q, H * D, q.data_ptr<T>() + b * H * D);
    std::copy_n(row + c.k, Hkv * D, k.data_ptr<T>() + b * Hkv * D);
    std::copy_n(row + c.v, Hkv * D, v.data_ptr<T>() + b * Hkv * D);
  }
  c10::optional<at::Tensor> relative, turns;
  if (block.relative.defined()) relative = block.relative.unsqueeze(0).expand({B, Hkv, G, block.vq_block + 1});
  if (block.rerope > 0) turns = block.rerope_frequencies;
  const std::vector<at::Tensor>& window = block.vq_window;
  vq_decode_step(q, k, v, block.search_t, block.norms, block.codebook_t, window[0], window[1], window[2], window[3],
                 block.vq_block, vq_position, block.scale, relative, block.keys_are_codes, block.rerope, turns,
                 c10::nullopt, false, out, codes);
  std::copy_n(out.data_ptr<T>(), B * H * D, o);
}

template <typename T>
void mixer(BlockModelStep::Block& block, const T* x, int64_t B, int64_t d, int64_t position, int64_t vq_position,
           T* y) {
  const int64_t H = block.heads, Hkv = block.kv_heads, D = block.head_dim, G = H / Hkv;
  const Columns c = columns(block);
  const int64_t P = c.width;
  std::vector<T> p(B * P);
  rows_times(x, B, d, block.in_t.data_ptr<T>(), P, static_cast<const T*>(nullptr), p.data());
  const T* in_bias = block.in_bias.defined() ? block.in_bias.data_ptr<T>() : nullptr;
  std::vector<T> a(B * Hkv * D, T(1));  // each row's decay, per key channel
  std::vector<T> beta(B * Hkv, T(1));
  for (int64_t b = 0; b < B; ++b) {
    T* row = p.data() + b * P;
    const T r = linattn_native::inverse_rms(x + b * d, d, block.mixer_eps);
    for (int64_t i = 0; i < P; ++i) row[i] = row[i] * r + (in_bias != nullptr ? in_bias[i] : T(0));
    const int64_t C = c.gate;  // q, k and v
    if (block.conv_kernel > 0) {
      const int64_t K = block.conv_kernel;
      const T* w = block.conv_weight.data_ptr<T>();
      const T* bias = block.conv_bias.data_ptr<T>();
      T* cache = K > 1 ? block.conv.data_ptr<T>() + b * C * (K - 1) : nullptr;
      for (int64_t ch = 0; ch < C; ++ch) {
        T sum = bias[ch];
        for (int64_t i = 0; i + 1 < K; ++i) sum += w[ch * K + i] * cache[ch * (K - 1) + i];
        sum += w[ch * K + K - 1] * row[ch];
        if (K > 1) {
          T* history = cache + ch * (K - 1);
          std::copy(history + 1, history + K - 1, history);
          history[K - 2] = row[ch];
        }
        row[ch] = silu(sum);
      }
    } else if (block.silu_qkv) {
      for (int64_t ch = 0; ch < C; ++ch) row[ch] = silu(row[ch]);
    }
    if (block.frequencies.defined()) {
      const T* f = block.frequencies.data_ptr<T>();
      linattn_native::rotate(row + c.q, H, D, f, position);
      linattn_native::rotate(row + c.k, Hkv, D, f, position);
    }
    if (block.beta) {
      for (int64_t j = 0; j < Hkv; ++j) beta[b * Hkv + j] = sigmoid(row[c.beta + j]);
    }
    T* decay = a.data() + b * Hkv * D;
    if (block.decay == 1 || block.decay == 2) {
      for (int64_t j = 0; j < Hkv; ++j) {
        T g;
        if (block.decay == 1) {
          g = block.log_decay.data_ptr<T>()[j];
        } else {
          g = -block.decay_rate.data_ptr<T>()[j] * softplus(row[c.decay + j] + block.dt_bias.data_ptr<T>()[j]);
        }
        std::fill_n(decay + j * D, D, std::exp(g));
      }
    } else if (block.decay == 3) {
      rows_times(static_cast<const T*>(row + c.decay), 1, block.rank, block.decay_up_t.data_ptr<T>(), Hkv * D,
                 block.decay_bias.data_ptr<T>(), decay);
      const T temperature = static_cast<T>(block.temperature);
      for (int64_t i = 0; i < Hkv * D; ++i) decay[i] = std::exp(log_sigmoid(decay[i]) / temperature);
    }
  }

  std::vector<T> o(B * H * D);
  if (block.vq_heads) {
    attend_vq(block, p.data(), P, c, B, vq_position, o.data());
  } else if (block.softmax > 0) {
    attend(block, p.data(), P, c, B, position, o.data());
  } else {
    recur(block, p.data(), P, c, a.data(), beta.data(), B, o.data());
  }
  const T head_eps = static_cast<T>(block.head_eps);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      T* out = o.data() + (b * H + h) * D;
      if (block.head_norm == 1) {
        const T r = linattn_native::inverse_rms(out, D, head_eps);
        const T* gain = block.head_gain.data_ptr<T>();
        for (int64_t e = 0; e < D; ++e) out[e] = out[e] * r * gain[e];
      } else if (block.head_norm == 2) {
        T mean = 0, variance = 0;
        for (int64_t e = 0; e < D; ++e) mean += out[e];
        mean /= static_cast<T>(D);
        for (int64_t e = 0; e < D; ++e) variance += (out[e] - mean) * (out[e] - mean);
        const T r = T(1) / std::sqrt(variance / static_cast<T>(D) + head_eps);
        const T* gain = block.head_gain.data_ptr<T>() + h * D;
        const T* bias = block.head_bias.data_ptr<T>() + h * D;
        for (int64_t e = 0; e < D; ++e) out[e] = (out[e] - mean) * r * gain[e] + bias[e];
      }
      if (block.gate) {
        const T* gate = p.data() + b * P + c.gate + h * D;
        for (int64_t e = 0; e < D; ++e) out[e] *= silu(gate[e]);
      }
    }
  }
  rows_times(static_cast<const T*>(o.data()), B, H * D, block.out_t.data_ptr<T>(), d,
             block.out_bias.defined() ? block.out_bias.data_ptr<T>() : nullptr, y);
}

template <typename T>
void feed_forward(const BlockModelStep::Block& block, const T* x, int64_t B, int64_t d, T* y) {
  const int64_t F = block.ffn;
  std::vector<T> gate_up(B * 2 * F), hidden(B * F);
  rows_times(x, B, d, block.gate_up_t.data_ptr<T>(), 2 * F, static_cast<const T*>(nullptr), gate_up.data());
  for (int64_t b = 0; b < B; ++b) {
    const T r = linattn_native::inverse_rms(x + b * d, d, block.ffn_eps);
    const T* row = gate_up.data() + b * 2 * F;
    for (int64_t i = 0; i < F; ++i) hidden[b * F + i] = silu(row[i] * r) * (row[F + i] * r);
  }
  rows_times(static_cast<const T*>(hidden.data()), B, F, block.down_t.data_ptr<T>(), d,
             static_cast<const T*>(nullptr), y);
}

}  // namespace

void BlockModelStep::step(const at::Tensor& ids, int64_t position, at::Tensor logits,
                          const c10::optional<at::Tensor>& greedy, int64_t vq_position) {
  TORCH_CHECK(ids.dim() == 1, kWhat, ": ids must be [B] int64");
  const int64_t B = ids.size(0), d = embed_.size(1);
  linattn_native::check_outputs(kWhat, logits, B, head_t_.size(1), embed_.scalar_type(), greedy);
  const at::Tensor id_rows = linattn_native::checked_ids(kWhat, ids, embed_.size(0));
  const int64_t* id = id_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < blocks(); ++i) {
    const Block& block = blocks_[i];
    const bool windowed = block.vq || block.vq_heads;
    const at::Tensor& held = windowed ? (block.vq_window.empty() ? at::Tensor() : block.vq_window[0])
                                      : (block.softmax > 0 ? block.keys : block.memory);
    TORCH_CHECK(held.defined() && held.size(0) == B, kWhat, ": block ", i, " holds no state of ", B,
                " rows (set_state or set_window)");
    TORCH_CHECK(!windowed || (vq_position >= 0 && vq_position < block.vq_block), kWhat, ": vq_position ",
                vq_position, " is not in [0, ", block.vq_block, ")");
  }
  at::Tensor x_rows = at::empty({B, d}, embed_.options()), y_rows = at::empty({B, d}, embed_.options());
  at::Tensor new_codes = at::empty({B, 1}, ids.options().dtype(at::kLong)), commit = at::empty({}, embed_.options());
  AT_DISPATCH_FLOATING_TYPES(embed_.scalar_type(), "BlockModelStep", [&] {
    scalar_t* x = x_rows.data_ptr<scalar_t>();
    scalar_t* y = y_rows.data_ptr<scalar_t>();
    linattn_native::embed_rows(embed_.data_ptr<scalar_t>(), id, B, d, x);
    for (Block& block : blocks_) {
      if (block.softmax_unit) {  // x + unit(x), the unit's norm inside it
        const std::vector<at::Tensor>& c = block.vq_constants;
        gau_softmax_step(x_rows, c[0], block.input_shift, block.vq_eps, c[1], c[2], c[3], c[4], block.keys,
                         block.values, block.length, block.vq_block, block.entropy, y_rows);
        block.length += 1;
        for (int64_t i = 0; i < B * d; ++i) x[i] += y[i];
        continue;
      }
      if (block.vq) {  // x + unit(x), the unit's norm inside it
        const std::vector<at::Tensor>& c = block.vq_constants;
        vq_gau_step(x_rows, c[0], block.input_shift, block.vq_eps, c[1], c[2], c[3], c[4], c[5], c[6], c[7],
                    block.vq_window[0], block.vq_window[1], block.vq_window[2], block.vq_window[3], block.vq_block,
                    vq_position,
                    block.keys_are_codes, 0.0, block.rerope,
                    block.rerope > 0 ? c10::optional<at::Tensor>(block.rerope_frequencies) : c10::nullopt, block.fsq,
                    block.soft_temperature, y_rows, new_codes, commit);
        for (int64_t i = 0; i < B * d; ++i) x[i] += y[i];
        continue;
      }
      mixer(block, static_cast<const scalar_t*>(x), B, d, position, vq_position, y);
      for (int64_t i = 0; i < B * d; ++i) x[i] += y[i];
      feed_forward(block, static_cast<const scalar_t*>(x), B, d, y);
      for (int64_t i = 0; i < B * d; ++i) x[i] += y[i];
    }
    linattn_native::final_logits(x, B, d, norm_weight_.data_ptr<scalar_t>(), norm_eps_,
                                 head_t_.data_ptr<scalar_t>(), head_t_.size(1), logits.data_ptr<scalar_t>(),
                                 greedy.has_value() ? greedy->data_ptr<int64_t>() : nullptr);
  });
}

}  // namespace linattn
