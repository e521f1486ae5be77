// One token through a Transformer-VQ gated attention unit, in one call (nn/_gau_decode.py's
// decode_token on a CPU). For x [B, d] in float32 or float64, with the unit's derived
// constants (the input norm's gain folded into the input matrix):
//
//   h        = (x W_in) / sqrt(mean(x^2) + eps)  (+ W b)           W_in [d, 2 d_k + 2 d_v]
//   q, k     = h[:d_k], h[d_k:2 d_k], each / sqrt(mean(.^2) + 1e-6) * d_k^-1/4
//   v, g     = SiLU(h[2 d_k:2 d_k + d_v]), SiLU(h[2 d_k + d_v:])
//   r        = b_rev + (q + u) P_rev                                 offsets L .. 0
//   o, z     = vq_decode_step(q + u, k, v, r) over the resident buffer (vq_decode_step.cpp)
//              (a unit with ReRoPE, `rerope` w > 0: vq_decode_step(q, k, v) with ReRoPE, no u, no r;
//              a unit with finite scalar quantization, `fsq` given: z = sum_i (round(b_i) + r_i) radix_i,
//              b = tanh(W_in k + shift) * half - offset, r = floor(levels / 2), nn/fsq.py;
//              soft VQ, `soft_temperature` tau > 0: a = softmax_s(-|k - c_s|^2 / 2 tau) written into the
//              soft codes, and the soft key a C enters the buffer instead of a code, ops/vq/soft.py)
//   commit   = sum_b |k_b - c_{z_b}|^2 * weight / B                 (float32, float64 for float64)
//   y        = (o * g) W_o^T
//
// gau_softmax_step is the unit with exact softmax instead (GAU(attention="softmax")): the new k
// and v written at row t of a preallocated cache (keys [B, 1, rows, d_k], values [B, 1, rows, d_v]),
// then o = softmax_j(c ((q + u).k_j + r_{t - j})) . v_j over rows j = 0 .. t, r_delta the relative
// terms for offsets delta <= L (none beyond), c = log(t + 1) / log(512) with the entropy scale, else 1.
//
// The three products are row_products.h's; everything else is one loop per row. Nothing
// depends on the thread count (the decode step and the softmax unit run one row per task, the
// products add in a fixed order, the other loops run on the calling thread).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"
#include "native_checks.h"
#include "lm_ends.h"
#include "row_products.h"
#include "vq_kernels.h"


namespace {

template <typename T>
T silu(T x) {
  return x / (T(1) + linattn_native::exp_of(-x));
}

// What both kinds of unit compute before their attention: the input product h, the queries
// q + u (or q alone with ReRoPE) [B, 1, 1, d_k], the keys [B, 1, d_k], the values [B, 1, d_v],
// the gates (in h, after SiLU) and, without ReRoPE, the relative terms [B, 1, 1, L + 1] (offsets L .. 0).
struct UnitFront {
  at::Tensor h, queries, k, v;
  c10::optional<at::Tensor> relative;
  int64_t B, d, d_k, d_v, width;
};

template <typename T>
UnitFront unit_front(const char* what, const at::Tensor& x, const at::Tensor& input_t,
                     const c10::optional<at::Tensor>& input_shift, double eps, const at::Tensor& content_bias,
                     const at::Tensor& position_keys_reversed_t, const at::Tensor& bias_reversed,
                     const at::Tensor& output_t, int64_t L, bool rerope, const at::Tensor& y) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && input_t.dim() == 2 && position_keys_reversed_t.dim() == 2 && output_t.dim() == 2, what,
              ": x [B, d], input_t [d, 2 d_k + 2 d_v], position_keys_reversed_t [d_k, L + 1], output_t [d_v, d]");
  UnitFront f;
  f.B = x.size(0), f.d = x.size(1), f.d_k = position_keys_reversed_t.size(0), f.d_v = output_t.size(0);
  const int64_t B = f.B, d = f.d, d_k = f.d_k, d_v = f.d_v, width = f.width = 2 * d_k + 2 * d_v;
  const auto check = [what](const at::Tensor& t, const char* name, at::ScalarType type, at::IntArrayRef shape) {
    linattn_native::check_tensor(what, t, name, type, shape);
  };
  check(x, "x", dtype, {B, d});
  check(input_t, "input_t", dtype, {d, width});
  if (input_shift.has_value()) check(*input_shift, "input_shift", dtype, {width});
  check(content_bias, "content_bias", dtype, {d_k});
  check(position_keys_reversed_t, "position_keys_reversed_t", dtype, {d_k, L + 1});
  check(bias_reversed, "bias_reversed", dtype, {L + 1});
  check(output_t, "output_t", dtype, {d_v, d});
  check(y, "y", dtype, {B, d});

  f.h = at::empty({B, width}, x.options());
  linattn::rows_times(x.data_ptr<T>(), B, d, input_t.data_ptr<T>(), width, static_cast<const T*>(nullptr),
                      f.h.data_ptr<T>());
  f.queries = at::empty({B, 1, 1, d_k}, x.options());
  f.k = at::empty({B, 1, d_k}, x.options());
  f.v = at::empty({B, 1, d_v}, x.options());
  const T* x_data = x.data_ptr<T>();
  T* h_data = f.h.data_ptr<T>();
  const T* shift = input_shift.has_value() ? input_shift->data_ptr<T>() : nullptr;
  const T* u = content_bias.data_ptr<T>();
  T* q_data = f.queries.data_ptr<T>();
  T* k_data = f.k.data_ptr<T>();
  T* v_data = f.v.data_ptr<T>();
  const T qk_scale = static_cast<T>(std::pow(static_cast<double>(d_k), -0.25));
  for (int64_t b = 0; b < B; ++b) {
    T* row = h_data + b * width;
    const T r = linattn_native::inverse_rms(x_data + b * d, d, eps);
    for (int64_t i = 0; i < width; ++i) row[i] = row[i] * r + (shift != nullptr ? shift[i] : T(0));
    const T rq = linattn_native::inverse_rms(row, d_k, 1e-6) * qk_scale;
    const T rk = linattn_native::inverse_rms(row + d_k, d_k, 1e-6) * qk_scale;
    for (int64_t i = 0; i < d_k; ++i) {
      q_data[b * d_k + i] = row[i] * rq + (rerope ? T(0) : u[i]);
      k_data[b * d_k + i] = row[d_k + i] * rk;
    }
    for (int64_t i = 2 * d_k; i < width; ++i) row[i] = silu(row[i]);  // v, then the gate
    for (int64_t i = 0; i < d_v; ++i) v_data[b * d_v + i] = row[2 * d_k + i];
  }
  if (!rerope) {
    f.relative = at::empty({B, 1, 1, L + 1}, x.options());  // offsets L .. 0
    linattn::rows_times(static_cast<const T*>(q_data), B, d_k, position_keys_reversed_t.data_ptr<T>(), L + 1,
                        bias_reversed.data_ptr<T>(), f.relative->data_ptr<T>());
  }
  return f;
}

// y = (o * gate) W_o^T for the attention's output o [B, d_v].
template <typename T>
void unit_output(const UnitFront& f, T* o, const at::Tensor& output_t, at::Tensor& y) {
  const T* h_data = f.h.data_ptr<T>();
  for (int64_t b = 0; b < f.B; ++b) {
    const T* gate = h_data + b * f.width + 2 * f.d_k + f.d_v;
    for (int64_t i = 0; i < f.d_v; ++i) o[b * f.d_v + i] *= gate[i];
  }
  linattn::rows_times(static_cast<const T*>(o), f.B, f.d_v, output_t.data_ptr<T>(), f.d, static_cast<const T*>(nullptr),
                      y.data_ptr<T>());
}

// An FSQ unit's codes [B, 1]: each key's grid point in mixed radix (nn/fsq.py), from fsq = w_in
// [n, d_k], half, offset, shift, radius [n], radix [n] int64.
template <typename T>
at::Tensor fsq_codes(const std::vector<at::Tensor>& fsq, const UnitFront& f) {
  constexpr const char* kWhat = "vq_gau_step (native)";
  const auto dtype = f.k.scalar_type();
  const int64_t B = f.B, d_k = f.d_k;
  TORCH_CHECK(fsq.size() == 6 && fsq[0].dim() == 2, kWhat, ": fsq is w_in [d, d_k], half, offset, shift, "
              "radius [d], radix [d] int64");
  const int64_t n = fsq[0].size(0);
  linattn_native::check_tensor(kWhat, fsq[0], "fsq w_in", dtype, {n, d_k});
  for (int64_t i = 1; i <= 4; ++i) linattn_native::check_tensor(kWhat, fsq[i], "fsq constants", dtype, {n});
  linattn_native::check_tensor(kWhat, fsq[5], "fsq radix", at::kLong, {n});
  at::Tensor codes = at::empty({B, 1}, f.k.options().dtype(at::kLong));
  const T* k_data = f.k.data_ptr<T>();
  const T* w_in = fsq[0].data_ptr<T>();
  const T *half = fsq[1].data_ptr<T>(), *offset = fsq[2].data_ptr<T>(), *shift = fsq[3].data_ptr<T>();
  const T* radius = fsq[4].data_ptr<T>();
  const int64_t* radix = fsq[5].data_ptr<int64_t>();
  int64_t* z = codes.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    int64_t code = 0;
    for (int64_t i = 0; i < n; ++i) {
      T projected = 0;
      for (int64_t j = 0; j < d_k; ++j) projected += w_in[i * d_k + j] * k_data[b * d_k + j];
      const T bounded = std::tanh(projected + shift[i]) * half[i] - offset[i];
      code += (static_cast<int64_t>(std::nearbyint(bounded)) + static_cast<int64_t>(radius[i])) * radix[i];
    }
    z[b] = code;
  }
  return codes;
}

// A soft-VQ unit's soft keys [B, 1, d_k] = a C, with a = softmax_s(-|k - c_s|^2 / 2 tau) written
// into row L + p of the soft codes [B, 1, 2L, S] (codebook_t [1, d_k, S], ops/vq/soft.py).
template <typename T>
at::Tensor soft_keys(const at::Tensor& codebook_t, at::Tensor& codes, double temperature, int64_t L, int64_t p,
                     const UnitFront& f) {
  constexpr const char* kWhat = "vq_gau_step (native)";
  const auto dtype = f.k.scalar_type();
  const int64_t B = f.B, d_k = f.d_k, S = codebook_t.size(2);
  linattn_native::check_tensor(kWhat, codebook_t, "codebook_t", dtype, {1, d_k, S});
  linattn_native::check_tensor(kWhat, codes, "codes", dtype, {B, 1, 2 * L, S});
  at::Tensor key = at::empty({B, 1, d_k}, f.k.options());
  const T* k_data = f.k.data_ptr<T>();
  const T* book = codebook_t.data_ptr<T>();  // [d_k, S]
  T* soft_codes = codes.data_ptr<T>();
  T* soft_key = key.data_ptr<T>();
  std::vector<T> norms_s(S, T(0)), distance(S);
  for (int64_t e = 0; e < d_k; ++e) {
    for (int64_t s = 0; s < S; ++s) norms_s[s] += book[e * S + s] * book[e * S + s];
  }
  const T inverse = static_cast<T>(-1.0 / (2.0 * temperature));
  for (int64_t b = 0; b < B; ++b) {
    const T* kb = k_data + b * d_k;
    T squared = 0;
    for (int64_t e = 0; e < d_k; ++e) squared += kb[e] * kb[e];
    for (int64_t s = 0; s < S; ++s) distance[s] = T(0);
    for (int64_t e = 0; e < d_k; ++e) {
      for (int64_t s = 0; s < S; ++s) distance[s] += kb[e] * book[e * S + s];
    }
    T largest = -std::numeric_limits<T>::infinity();
    for (int64_t s = 0; s < S; ++s) {
      distance[s] = (squared - T(2) * distance[s] + norms_s[s]) * inverse;
      largest = std::max(largest, distance[s]);
    }
    T total = 0;
    for (int64_t s = 0; s < S; ++s) total += (distance[s] = std::exp(distance[s] - largest));
    T* a = soft_codes + (b * 2 * L + L + p) * S;
    for (int64_t s = 0; s < S; ++s) a[s] = distance[s] / total;
    for (int64_t e = 0; e < d_k; ++e) {
      T sum = 0;
      for (int64_t s = 0; s < S; ++s) sum += a[s] * book[e * S + s];
      soft_key[b * d_k + e] = sum;
    }
  }
  return key;
}

template <typename T>
void gau_rows(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
              double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
              const at::Tensor& bias_reversed, const at::Tensor& output_t, const at::Tensor& search_t,
              const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor& keys, at::Tensor& values,
              at::Tensor& codes, at::Tensor& mask, int64_t L, int64_t p, bool keys_are_codes,
              double commitment_weight, int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
              const std::vector<at::Tensor>& fsq, double soft_temperature, at::Tensor& y, at::Tensor& new_codes,
              at::Tensor& commit) {
  constexpr const char* kWhat = "vq_gau_step (native)";
  const auto dtype = x.scalar_type();
  const UnitFront f = unit_front<T>(kWhat, x, input_t, input_shift, eps, content_bias, position_keys_reversed_t,
                                    bias_reversed, output_t, L, rerope > 0, y);
  const int64_t B = f.B, d_k = f.d_k, d_v = f.d_v;
  linattn_native::check_tensor(kWhat, commit, "commit", dtype, {});
  const bool soft = soft_temperature > 0;
  c10::optional<at::Tensor> given_codes;
  if (!fsq.empty()) given_codes = fsq_codes<T>(fsq, f);
  at::Tensor key = soft ? soft_keys<T>(codebook_t, codes, soft_temperature, L, p, f) : f.k;
  at::Tensor out = at::empty({B, 1, 1, d_v}, x.options());
  linattn::vq_decode_step(f.queries, key, f.v, search_t, norms, codebook_t, keys, values, codes, mask, L, p, 1.0,
                          f.relative, keys_are_codes && !soft, rerope, rerope_frequencies, given_codes, soft, out,
                          new_codes);

  T error = 0;  // the quantizer's precision: float32, float64 for float64 keys (soft VQ has no commitment)
  if (!soft) {
    const T* k_data = f.k.data_ptr<T>();
    const T* key_data = keys.data_ptr<T>();
    const int64_t columns = keys.size(2);
    for (int64_t b = 0; b < B; ++b) {
      const T* k_hat = key_data + (b * columns + L + p) * d_k;  // the new row of the buffer: c_z
      for (int64_t i = 0; i < d_k; ++i) {
        const T e = k_data[b * d_k + i] - k_hat[i];
        error += e * e;
      }
    }
  }
  commit.fill_(error * static_cast<T>(commitment_weight / static_cast<double>(B)));
  unit_output<T>(f, out.data_ptr<T>(), output_t, y);
}

template <typename T>
void gau_softmax_rows(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                      double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                      const at::Tensor& bias_reversed, const at::Tensor& output_t, at::Tensor& keys,
                      at::Tensor& values, int64_t length, int64_t L, bool entropy, at::Tensor& y) {
  constexpr const char* kWhat = "gau_softmax_step (native)";
  const UnitFront f = unit_front<T>(kWhat, x, input_t, input_shift, eps, content_bias, position_keys_reversed_t,
                                    bias_reversed, output_t, L, false, y);
  const int64_t B = f.B, d_k = f.d_k, d_v = f.d_v;
  TORCH_CHECK(keys.dim() == 4, kWhat, ": keys is [B, 1, rows, d_k]");
  const int64_t rows = keys.size(2), t = length;
  linattn_native::check_tensor(kWhat, keys, "keys", x.scalar_type(), {B, 1, rows, d_k});
  linattn_native::check_tensor(kWhat, values, "values", x.scalar_type(), {B, 1, rows, d_v});
  TORCH_CHECK(t >= 0 && t < rows, kWhat, ": the cache of ", rows, " rows has no room after ", t);
  const T* q_data = f.queries.data_ptr<T>();
  const T* k_data = f.k.data_ptr<T>();
  const T* v_data = f.v.data_ptr<T>();
  const T* relative = f.relative->data_ptr<T>();
  T* K = keys.data_ptr<T>();
  T* V = values.data_ptr<T>();
  const T scale = entropy ? static_cast<T>(std::log(static_cast<double>(t + 1)) / std::log(512.0)) : T(1);
  at::Tensor out = at::empty({B, d_v}, x.options());
  T* o_data = out.data_ptr<T>();
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores(t + 1);
    for (int64_t b = begin; b < end; ++b) {
      T* Kb = K + b * rows * d_k;
      T* Vb = V + b * rows * d_v;
      std::copy_n(k_data + b * d_k, d_k, Kb + t * d_k);
      std::copy_n(v_data + b * d_v, d_v, Vb + t * d_v);
      const T* q = q_data + b * d_k;
      const T* r = relative + b * (L + 1);  // offset delta at L - delta
      T largest = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j <= t; ++j) {
        T dot = 0;
        for (int64_t e = 0; e < d_k; ++e) dot += q[e] * Kb[j * d_k + e];
        const int64_t offset = t - j;
        if (offset <= L) dot += r[L - offset];
        scores[j] = dot * scale;
        largest = std::max(largest, scores[j]);
      }
      T total = 0;
      for (int64_t j = 0; j <= t; ++j) total += (scores[j] = linattn_native::exp_of(scores[j] - largest));
      T* o = o_data + b * d_v;
      std::fill_n(o, d_v, T(0));
      for (int64_t j = 0; j <= t; ++j) {
        const T w = scores[j] / total;
        for (int64_t e = 0; e < d_v; ++e) o[e] += w * Vb[j * d_v + e];
      }
    }
  });
  unit_output<T>(f, o_data, output_t, y);
}

}  // namespace

namespace linattn {

void vq_gau_step(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                 double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                 const at::Tensor& bias_reversed, const at::Tensor& output_t, const at::Tensor& search_t,
                 const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                 at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, bool keys_are_codes, double commitment_weight,
                 int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
                 const std::vector<at::Tensor>& fsq, double soft_temperature, at::Tensor y, at::Tensor new_codes,
                 at::Tensor commit) {
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "vq_gau_step", [&] {
    gau_rows<scalar_t>(x, input_t, input_shift, eps, content_bias, position_keys_reversed_t, bias_reversed, output_t,
                       search_t, norms, codebook_t, keys, values, codes, mask, L, p, keys_are_codes,
                       commitment_weight, rerope, rerope_frequencies, fsq, soft_temperature, y, new_codes, commit);
  });
}

void gau_softmax_step(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                      double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                      const at::Tensor& bias_reversed, const at::Tensor& output_t, at::Tensor keys, at::Tensor values,
                      int64_t length, int64_t L, bool entropy, at::Tensor y) {
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "gau_softmax_step", [&] {
    gau_softmax_rows<scalar_t>(x, input_t, input_shift, eps, content_bias, position_keys_reversed_t, bias_reversed,
                               output_t, keys, values, length, L, entropy, y);
  });
}

}  // namespace linattn
