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
//              b = tanh(W_in k + shift) * half - offset, r = floor(levels / 2), nn/fsq.py)
//   commit   = sum_b |k_b - c_{z_b}|^2 * weight / B                 (float32, float64 for float64)
//   y        = (o * g) W_o^T
//
// The three products are row_products.h's; everything else is one loop per row. Nothing
// depends on the thread count (the decode step runs one row per task, the products add in a
// fixed order, the loops here run on the calling thread).
#include <ATen/ATen.h>

#include <cmath>
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

template <typename T>
void gau_rows(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
              double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
              const at::Tensor& bias_reversed, const at::Tensor& output_t, const at::Tensor& search_t,
              const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor& keys, at::Tensor& values,
              at::Tensor& codes, at::Tensor& mask, int64_t L, int64_t p, bool keys_are_codes,
              double commitment_weight, int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
              const std::vector<at::Tensor>& fsq, at::Tensor& y, at::Tensor& new_codes, at::Tensor& commit) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && input_t.dim() == 2 && position_keys_reversed_t.dim() == 2 && output_t.dim() == 2,
              "vq_gau_step (native): x [B, d], input_t [d, 2 d_k + 2 d_v], position_keys_reversed_t [d_k, L + 1], "
              "output_t [d_v, d]");
  const int64_t B = x.size(0), d = x.size(1), d_k = position_keys_reversed_t.size(0), d_v = output_t.size(0);
  const int64_t width = 2 * d_k + 2 * d_v;
  const auto check = [](const at::Tensor& t, const char* name, at::ScalarType type, at::IntArrayRef shape) {
    linattn_native::check_tensor("vq_gau_step (native)", t, name, type, shape);
  };
  check(x, "x", dtype, {B, d});
  check(input_t, "input_t", dtype, {d, width});
  if (input_shift.has_value()) check(*input_shift, "input_shift", dtype, {width});
  check(content_bias, "content_bias", dtype, {d_k});
  check(position_keys_reversed_t, "position_keys_reversed_t", dtype, {d_k, L + 1});
  check(bias_reversed, "bias_reversed", dtype, {L + 1});
  check(output_t, "output_t", dtype, {d_v, d});
  check(y, "y", dtype, {B, d});
  check(commit, "commit", dtype, {});

  at::Tensor h = at::empty({B, width}, x.options());
  linattn::rows_times(x.data_ptr<T>(), B, d, input_t.data_ptr<T>(), width, static_cast<const T*>(nullptr),
                      h.data_ptr<T>());
  at::Tensor queries = at::empty({B, 1, 1, d_k}, x.options());
  at::Tensor k = at::empty({B, 1, d_k}, x.options());
  at::Tensor v = at::empty({B, 1, d_v}, x.options());
  const T* x_data = x.data_ptr<T>();
  T* h_data = h.data_ptr<T>();
  const T* shift = input_shift.has_value() ? input_shift->data_ptr<T>() : nullptr;
  const T* u = content_bias.data_ptr<T>();
  T* q_data = queries.data_ptr<T>();
  T* k_data = k.data_ptr<T>();
  T* v_data = v.data_ptr<T>();
  const T qk_scale = static_cast<T>(std::pow(static_cast<double>(d_k), -0.25));
  for (int64_t b = 0; b < B; ++b) {
    T* row = h_data + b * width;
    const T r = linattn_native::inverse_rms(x_data + b * d, d, eps);
    for (int64_t i = 0; i < width; ++i) row[i] = row[i] * r + (shift != nullptr ? shift[i] : T(0));
    const T rq = linattn_native::inverse_rms(row, d_k, 1e-6) * qk_scale, rk = linattn_native::inverse_rms(row + d_k, d_k, 1e-6) * qk_scale;
    for (int64_t i = 0; i < d_k; ++i) {
      q_data[b * d_k + i] = row[i] * rq + (rerope == 0 ? u[i] : T(0));
      k_data[b * d_k + i] = row[d_k + i] * rk;
    }
    for (int64_t i = 2 * d_k; i < width; ++i) row[i] = silu(row[i]);  // v, then the gate
    for (int64_t i = 0; i < d_v; ++i) v_data[b * d_v + i] = row[2 * d_k + i];
  }
  c10::optional<at::Tensor> given_codes;
  if (!fsq.empty()) {  // the FSQ grid point of each key
    TORCH_CHECK(fsq.size() == 6 && fsq[0].dim() == 2, "vq_gau_step (native): fsq is w_in [d, d_k], half, offset, "
                "shift, radius [d], radix [d] int64");
    const int64_t n = fsq[0].size(0);
    check(fsq[0], "fsq w_in", dtype, {n, d_k});
    for (int64_t i = 1; i <= 4; ++i) check(fsq[i], "fsq constants", dtype, {n});
    check(fsq[5], "fsq radix", at::kLong, {n});
    given_codes = at::empty({B, 1}, x.options().dtype(at::kLong));
    const T* w_in = fsq[0].data_ptr<T>();
    const T *half = fsq[1].data_ptr<T>(), *offset = fsq[2].data_ptr<T>(), *shift_i = fsq[3].data_ptr<T>();
    const T* radius = fsq[4].data_ptr<T>();
    const int64_t* radix = fsq[5].data_ptr<int64_t>();
    int64_t* z = given_codes->data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      int64_t code = 0;
      for (int64_t i = 0; i < n; ++i) {
        T projected = 0;
        for (int64_t j = 0; j < d_k; ++j) projected += w_in[i * d_k + j] * k_data[b * d_k + j];
        const T bounded = std::tanh(projected + shift_i[i]) * half[i] - offset[i];
        code += (static_cast<int64_t>(std::nearbyint(bounded)) + static_cast<int64_t>(radius[i])) * radix[i];
      }
      z[b] = code;
    }
  }
  c10::optional<at::Tensor> relative;
  if (rerope == 0) {
    relative = at::empty({B, 1, 1, L + 1}, x.options());  // offsets L .. 0
    linattn::rows_times(q_data, B, d_k, position_keys_reversed_t.data_ptr<T>(), L + 1, bias_reversed.data_ptr<T>(),
                        relative->data_ptr<T>());
  }
  at::Tensor out = at::empty({B, 1, 1, d_v}, x.options());
  linattn::vq_decode_step(queries, k, v, search_t, norms, codebook_t, keys, values, codes, mask, L, p, 1.0,
                          relative, keys_are_codes, rerope, rerope_frequencies, given_codes, out, new_codes);

  const T* key_data = keys.data_ptr<T>();
  const int64_t columns = keys.size(2);
  T error = 0;  // the quantizer's precision: float32, float64 for float64 keys
  for (int64_t b = 0; b < B; ++b) {
    const T* k_hat = key_data + (b * columns + L + p) * d_k;  // the new row of the buffer: c_z
    for (int64_t i = 0; i < d_k; ++i) {
      const T e = k_data[b * d_k + i] - k_hat[i];
      error += e * e;
    }
  }
  commit.fill_(error * static_cast<T>(commitment_weight / static_cast<double>(B)));

  T* o = out.data_ptr<T>();
  for (int64_t b = 0; b < B; ++b) {
    const T* gate = h_data + b * width + 2 * d_k + d_v;
    for (int64_t i = 0; i < d_v; ++i) o[b * d_v + i] *= gate[i];
  }
  linattn::rows_times(static_cast<const T*>(o), B, d_v, output_t.data_ptr<T>(), d, static_cast<const T*>(nullptr),
                      y.data_ptr<T>());
}

}  // namespace

namespace linattn {

void vq_gau_step(const at::Tensor& x, const at::Tensor& input_t, const c10::optional<at::Tensor>& input_shift,
                 double eps, const at::Tensor& content_bias, const at::Tensor& position_keys_reversed_t,
                 const at::Tensor& bias_reversed, const at::Tensor& output_t, const at::Tensor& search_t,
                 const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                 at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, bool keys_are_codes, double commitment_weight,
                 int64_t rerope, const c10::optional<at::Tensor>& rerope_frequencies,
                 const std::vector<at::Tensor>& fsq, at::Tensor y, at::Tensor new_codes, at::Tensor commit) {
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "vq_gau_step", [&] {
    gau_rows<scalar_t>(x, input_t, input_shift, eps, content_bias, position_keys_reversed_t, bias_reversed, output_t,
                       search_t, norms, codebook_t, keys, values, codes, mask, L, p, keys_are_codes,
                       commitment_weight, rerope, rerope_frequencies, fsq, y, new_codes, commit);
  });
}

}  // namespace linattn
