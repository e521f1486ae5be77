// The gradients of Transformer-VQ's causal block form (vq_block_forward.cpp) for hard codes,
// grad_scope "cache" or "state": the cache carries no gradient, everything else does.
//
// For CPU tensors in float32 or float64, in the forward's tasks: every (batch, kv head) row cut
// into segments of segment_blocks blocks, each segment one thread's, its cache at the start from
// the forward's scan (vq_cache_scan.h); what two segments would add into one place is kept apart
// and added in segment order afterwards, so the results do not depend on the thread count. Per
// segment, blocks in order, with the cache (counts n_s, means m_s = u_s / n_s) carried as the
// forward carried it. With the keys
// K = [K_{r-1}; K_r; C] and values V = [V_{r-1}; V_r; m] of block r (window, then cache), the
// rows of every query group stacked (Q [G L, Dk], dO [G L, Dv], O the forward's output) and
// lse the forward's row log-sum-exp:
//
//   x     = scale Q K^T + [bias + scale band | log n]     the forward's scores (one product)
//   p     = exp(x - lse)                                  its softmax
//   ds    = p (dO V^T - delta),   delta_a = dO_a . O_a    (one product)
//   dQ    = scale ds K + scale ds_band P                  (one product, and one with P)
//   dK_w  = scale ds_w^T Q,   dV_w = p_w^T dO             (the window's 2L columns)
//   dC   += scale ds_cache^T Q                            (the codebook, when asked)
//   dbias += ds_w,   dP += scale ds_band^T Q              (when asked)
//
// ds_w are the window's 2L columns, ds_band the same entries at offset delta = L + a - c of
// row a and column c (0 <= delta <= L), ds_cache the S cache columns. The window's first L
// columns are block r - 1's keys and values (block 0's: the carried ones): with prev_grad
// false (grad_scope "state") they get no gradient.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include "fast_exp.h"
#include "vq_block_inputs.h"
#include "vq_cache_scan.h"
#include "vq_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using linattn_native::check_tensor;
using linattn_native::exp_of;


// One score row's softmax and its gradient, in place: on entry `scores` holds q.k (not yet
// scaled) and `grads` holds dO . V; on exit `scores` holds p and `grads` holds scale ds.
// d_bias (the window's bias gradient row, or null) gets ds_w added; d_band (row [L + 1], or null)
// gets scale ds at each offset.
template <typename T>
void row_gradient(T* scores, T* grads, int64_t a, int64_t L, int64_t S, T scale, const T* bias, const T* band,
                  int64_t first, const T* counts, const T* log_counts, T lse, T delta, T* d_bias, T* d_band) {
  const int64_t W = 2 * L;
  for (int64_t c = 0; c < first; ++c) scores[c] = 0, grads[c] = 0;
#pragma omp simd
  for (int64_t c = first; c < W; ++c) scores[c] = scale * scores[c] + bias[c];
  if (band != nullptr) {  // columns c = a .. a + L: delta = L + a - c runs L .. 0
    const T* band_row = band + L + a;
    for (int64_t c = first > a ? first : a; c <= a + L; ++c) scores[c] += scale * band_row[-c];
  }
#pragma omp simd
  for (int64_t c = first; c < W; ++c) {
    const T p = exp_of(scores[c] - lse);
    const T ds = p * (grads[c] - delta);
    scores[c] = p;
    grads[c] = ds;
  }
  if (d_bias != nullptr) {
#pragma omp simd
    for (int64_t c = first; c < W; ++c) d_bias[c] += grads[c];
  }
  if (d_band != nullptr) {
    T* d_band_row = d_band + L + a;
    for (int64_t c = first > a ? first : a; c <= a + L; ++c) d_band_row[-c] = scale * grads[c];
  }
#pragma omp simd
  for (int64_t c = first; c < W; ++c) grads[c] *= scale;
  T* cache = scores + W;
  T* cache_grads = grads + W;
#pragma omp simd
  for (int64_t s = 0; s < S; ++s) {
    const T p = counts[s] == 0 ? T(0) : exp_of(scale * cache[s] + log_counts[s] - lse);
    cache_grads[s] = scale * p * (cache_grads[s] - delta);
    cache[s] = p;
  }
}

template <typename T>
void backward_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                   const at::Tensor& codebook, const at::Tensor& window,
                   const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                   const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                   double scale_, const at::Tensor& out, const at::Tensor& d_out, const at::Tensor& lse,
                   bool prev_grad, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv, at::Tensor& d_first_k,
                   at::Tensor& d_first_v, const c10::optional<at::Tensor>& d_codebook,
                   const c10::optional<at::Tensor>& d_window, const c10::optional<at::Tensor>& d_position_keys,
                   int64_t segment_blocks) {
  const auto dtype = q.scalar_type();
  const char* what = "vq block backward (native)";
  const auto n = linattn_native::check_block_inputs(what, q, k, v, prev_codes, codebook, window, position_keys,
                                                    first_k, first_v, counts, sums, out);
  const int64_t B = n.B, Hkv = n.Hkv, G = n.G, R = n.R, L = n.L, Dk = n.Dk, S = n.S, Dv = n.Dv;
  const int64_t W = 2 * L, C = W + S, GL = G * L, Wh = n.Wh, Wg = n.Wg, Ph = n.Ph, Pg = n.Pg;
  check_tensor(what, d_out, "d_out", dtype, {B, Hkv, G, R, L, Dv});
  check_tensor(what, lse, "lse", dtype, {B, Hkv, G, R, L});
  check_tensor(what, dq, "dq", dtype, {B, Hkv, G, R, L, Dk});
  check_tensor(what, dk, "dk", dtype, {B, Hkv, R, L, Dk});
  check_tensor(what, dv, "dv", dtype, {B, Hkv, R, L, Dv});
  check_tensor(what, d_first_k, "d_first_k", dtype, {B, Hkv, L, Dk});
  check_tensor(what, d_first_v, "d_first_v", dtype, {B, Hkv, L, Dv});
  if (d_codebook.has_value()) check_tensor(what, *d_codebook, "d_codebook", dtype, {B, Hkv, S, Dk});
  if (d_window.has_value()) check_tensor(what, *d_window, "d_window", dtype, {B, Hkv, Wg, L, W});
  TORCH_CHECK(!d_position_keys.has_value() || position_keys.has_value(), what, ": d_position_keys without position_keys");
  if (d_position_keys.has_value())
    check_tensor(what, *d_position_keys, "d_position_keys", dtype, {B, Hkv, Pg, L + 1, Dk});
  const int64_t* code_data = prev_codes.data_ptr<int64_t>();
  const auto options = q.options();
  const T scale = static_cast<T>(scale_);
  const T minus_inf = -std::numeric_limits<T>::infinity();
  TORCH_CHECK(segment_blocks >= 1, "vq block backward (native): segment_blocks ", segment_blocks, " < 1");

  // The cache at every segment's start, as the forward had it; every (row, segment) is a task.
  // What two tasks of a row would add into one place goes to the task's own buffer instead and
  // is added afterwards in segment order: a segment's first block's gradient for its previous
  // block (the last block of the segment before) and the partial sums of the codebook's, bias's
  // and position keys' gradients.
  const int64_t rows = B * Hkv, segments = (R + segment_blocks - 1) / segment_blocks, tasks = rows * segments;
  at::Tensor segment_counts = at::empty({rows, segments, S}, options);
  at::Tensor segment_sums = at::empty({rows, segments, S, Dv}, options);
  at::Tensor unused_counts = at::empty({rows, S}, options), unused_sums = at::empty({rows, S, Dv}, options);
  linattn_native::scan_caches<T>(rows, R, L, S, Dv, segment_blocks, has_prev, R, code_data, v.data_ptr<T>(),
                                 first_v.data_ptr<T>(), counts.data_ptr<T>(), sums.data_ptr<T>(),
                                 segment_counts.data_ptr<T>(), segment_sums.data_ptr<T>(), unused_counts.data_ptr<T>(),
                                 unused_sums.data_ptr<T>());
  at::Tensor boundary_k = at::zeros({tasks, L, Dk}, options), boundary_v = at::zeros({tasks, L, Dv}, options);
  at::Tensor codebook_partials = d_codebook.has_value() ? at::zeros({tasks, S, Dk}, options) : at::Tensor();
  at::Tensor window_partials = d_window.has_value() ? at::zeros({tasks, Wg, L, W}, options) : at::Tensor();
  at::Tensor position_partials = d_position_keys.has_value() ? at::zeros({tasks, Pg, L + 1, Dk}, options)
                                                             : at::Tensor();

  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scores = at::empty({GL, C}, options), grads = at::empty({GL, C}, options);
    at::Tensor queries = at::empty({GL, Dk}, options), out_grads = at::empty({GL, Dv}, options);
    at::Tensor keys = at::empty({C, Dk}, options), values = at::empty({C, Dv}, options);
    at::Tensor query_grads = at::empty({GL, Dk}, options);
    at::Tensor window_key_grads = at::empty({W, Dk}, options), window_value_grads = at::empty({W, Dv}, options);
    at::Tensor band = at::empty({G, L, L + 1}, options), band_grads = at::empty({G, L, L + 1}, options);
    std::vector<T> row_counts(S), log_counts(S), row_sums(S * Dv);
    T* key_data = keys.data_ptr<T>();
    T* value_data = values.data_ptr<T>();
    T* cache_means = value_data + W * Dv;  // the cache's means live in the values' last S rows
    T* score_data = scores.data_ptr<T>();
    T* grad_data = grads.data_ptr<T>();
    T* query_data = queries.data_ptr<T>();
    T* out_grad_data = out_grads.data_ptr<T>();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / segments, segment = task % segments;
      const int64_t h = bh % Hkv;
      const int64_t first_block = segment * segment_blocks;
      const int64_t last_block = std::min(R, first_block + segment_blocks);
      std::memcpy(key_data + W * Dk, codebook.data_ptr<T>() + h * S * Dk, S * Dk * sizeof(T));
      std::memcpy(row_counts.data(), segment_counts.data_ptr<T>() + task * S, S * sizeof(T));
      std::memcpy(row_sums.data(), segment_sums.data_ptr<T>() + task * S * Dv, S * Dv * sizeof(T));
      for (int64_t s = 0; s < S; ++s) {
        const T n = row_counts[s];
        for (int64_t e = 0; e < Dv; ++e) cache_means[s * Dv + e] = n == 0 ? T(0) : row_sums[s * Dv + e] / n;
      }
      const T* k_row = k.data_ptr<T>() + bh * R * L * Dk;
      const T* v_row = v.data_ptr<T>() + bh * R * L * Dv;
      T* dk_row = dk.data_ptr<T>() + bh * R * L * Dk;
      T* dv_row = dv.data_ptr<T>() + bh * R * L * Dv;
      const int64_t* codes_row = code_data + bh * R * L;
      const T* q_data = q.data_ptr<T>() + bh * G * R * L * Dk;
      const T* out_data = out.data_ptr<T>() + bh * G * R * L * Dv;
      const T* d_out_data = d_out.data_ptr<T>() + bh * G * R * L * Dv;
      const T* lse_data = lse.data_ptr<T>() + bh * G * R * L;
      T* dq_data = dq.data_ptr<T>() + bh * G * R * L * Dk;
      at::Tensor codebook_grads = d_codebook.has_value() ? codebook_partials[task] : at::Tensor();
      std::vector<at::Tensor> position_rows, position_grads;  // per query group: P^T [Dk, L + 1], dP [L + 1, Dk]
      for (int64_t g = 0; g < G && position_keys.has_value(); ++g) {
        position_rows.push_back((*position_keys)[Ph == 1 ? 0 : h][Pg == 1 ? 0 : g].t());
        if (d_position_keys.has_value()) position_grads.push_back(position_partials[task][Pg == 1 ? 0 : g]);
      }
      for (int64_t r = first_block; r < last_block; ++r) {
        const bool without_prev = r == 0 && !has_prev;
        const T* prev_k = r > 0 ? k_row + (r - 1) * L * Dk : first_k.data_ptr<T>() + bh * L * Dk;
        const T* prev_v = r > 0 ? v_row + (r - 1) * L * Dv : first_v.data_ptr<T>() + bh * L * Dv;
        std::memcpy(key_data, prev_k, L * Dk * sizeof(T));
        std::memcpy(key_data + L * Dk, k_row + r * L * Dk, L * Dk * sizeof(T));
        std::memcpy(value_data, prev_v, L * Dv * sizeof(T));
        std::memcpy(value_data + L * Dv, v_row + r * L * Dv, L * Dv * sizeof(T));
        for (int64_t g = 0; g < G; ++g) {
          std::memcpy(query_data + g * L * Dk, q_data + (g * R + r) * L * Dk, L * Dk * sizeof(T));
          std::memcpy(out_grad_data + g * L * Dv, d_out_data + (g * R + r) * L * Dv, L * Dv * sizeof(T));
        }
        for (int64_t s = 0; s < S; ++s) {
          const T n = row_counts[s];
          log_counts[s] = n == 0 ? minus_inf : std::log(n);
        }
        at::mm_out(scores, queries, keys.t());
        at::mm_out(grads, out_grads, values.t());
        if (position_keys.has_value()) {
          for (int64_t g = 0; g < G; ++g) {
            at::Tensor band_rows = band[g];
            at::mm_out(band_rows, queries.narrow(0, g * L, L), position_rows[g]);
          }
          band_grads.zero_();
        }
        const int64_t first = without_prev ? L : 0;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t window_index = (Wh == 1 ? 0 : h) * Wg + (Wg == 1 ? 0 : g);
          const T* bias = window.data_ptr<T>() + window_index * L * W;
          T* d_bias = d_window.has_value() ? window_partials.data_ptr<T>() + (task * Wg + (Wg == 1 ? 0 : g)) * L * W
                                           : nullptr;
          for (int64_t a = 0; a < L; ++a) {
            const int64_t i = g * L + a;
            const T* o = out_data + ((g * R + r) * L + a) * Dv;
            const T* d_o = out_grad_data + i * Dv;
            T delta = 0;
#pragma omp simd reduction(+ : delta)
            for (int64_t e = 0; e < Dv; ++e) delta += d_o[e] * o[e];
            row_gradient<T>(score_data + i * C, grad_data + i * C, a, L, S, scale, bias + a * W,
                            position_keys.has_value() ? band.data_ptr<T>() + i * (L + 1) : nullptr, first,
                            row_counts.data(), log_counts.data(), lse_data[(g * R + r) * L + a], delta,
                            d_bias == nullptr ? nullptr : d_bias + a * W,
                            position_keys.has_value() ? band_grads.data_ptr<T>() + i * (L + 1) : nullptr);
          }
        }
        // dQ = scale ds K (+ scale ds_band P), written into the block's rows of dq
        at::mm_out(query_grads, grads, keys);
        for (int64_t g = 0; g < G; ++g) {
          at::Tensor rows = query_grads.narrow(0, g * L, L);
          if (position_keys.has_value()) rows.addmm_(band_grads[g], position_rows[g].t());
          std::memcpy(dq_data + (g * R + r) * L * Dk, rows.data_ptr<T>(), L * Dk * sizeof(T));
          if (d_position_keys.has_value())
            position_grads[g].addmm_(band_grads[g].t(), queries.narrow(0, g * L, L));
        }
        // the window's keys and values: own block r, previous block r - 1 (or the carried one)
        at::mm_out(window_key_grads, grads.narrow(1, 0, W).t(), queries);
        at::mm_out(window_value_grads, scores.narrow(1, 0, W).t(), out_grads);
        const T* own_k_grad = window_key_grads.data_ptr<T>() + L * Dk;
        const T* own_v_grad = window_value_grads.data_ptr<T>() + L * Dv;
        T* dk_own = dk_row + r * L * Dk;
        T* dv_own = dv_row + r * L * Dv;
#pragma omp simd
        for (int64_t i = 0; i < L * Dk; ++i) dk_own[i] += own_k_grad[i];
#pragma omp simd
        for (int64_t i = 0; i < L * Dv; ++i) dv_own[i] += own_v_grad[i];
        if (prev_grad && !without_prev) {
          // block r - 1 (the carried block for block 0; the task's own buffer when it is another segment's)
          T* dk_prev = r == 0 ? d_first_k.data_ptr<T>() + bh * L * Dk
                              : (r == first_block ? boundary_k.data_ptr<T>() + task * L * Dk : dk_row + (r - 1) * L * Dk);
          T* dv_prev = r == 0 ? d_first_v.data_ptr<T>() + bh * L * Dv
                              : (r == first_block ? boundary_v.data_ptr<T>() + task * L * Dv : dv_row + (r - 1) * L * Dv);
          const T* prev_k_grad = window_key_grads.data_ptr<T>();
          const T* prev_v_grad = window_value_grads.data_ptr<T>();
#pragma omp simd
          for (int64_t i = 0; i < L * Dk; ++i) dk_prev[i] += prev_k_grad[i];
#pragma omp simd
          for (int64_t i = 0; i < L * Dv; ++i) dv_prev[i] += prev_v_grad[i];
        }
        if (d_codebook.has_value()) codebook_grads.addmm_(grads.narrow(1, W, S).t(), queries);
        if (!without_prev && r + 1 < last_block) {  // block r's previous block enters the cache
          const int64_t* entering = codes_row + r * L;
          linattn_native::enter_block(entering, prev_v, L, Dv, row_counts.data(), row_sums.data());
          for (int64_t j = 0; j < L; ++j) {
            const int64_t z = entering[j];
            for (int64_t e = 0; e < Dv; ++e) cache_means[z * Dv + e] = row_sums[z * Dv + e] / row_counts[z];
          }
        }
      }
    }
  });

  // what the tasks kept apart, added in segment order (one row per thread)
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      for (int64_t segment = 1; segment < segments && prev_grad; ++segment) {
        const int64_t task = bh * segments + segment, r = segment * segment_blocks;
        T* dk_prev = dk.data_ptr<T>() + (bh * R + r - 1) * L * Dk;
        T* dv_prev = dv.data_ptr<T>() + (bh * R + r - 1) * L * Dv;
        const T* k_part = boundary_k.data_ptr<T>() + task * L * Dk;
        const T* v_part = boundary_v.data_ptr<T>() + task * L * Dv;
        for (int64_t i = 0; i < L * Dk; ++i) dk_prev[i] += k_part[i];
        for (int64_t i = 0; i < L * Dv; ++i) dv_prev[i] += v_part[i];
      }
      const int64_t b = bh / Hkv, h = bh % Hkv;
      for (int64_t segment = 0; segment < segments; ++segment) {
        const int64_t task = bh * segments + segment;
        if (d_codebook.has_value()) (*d_codebook)[b][h].add_(codebook_partials[task]);
        if (d_window.has_value()) (*d_window)[b][h].add_(window_partials[task]);
        if (d_position_keys.has_value()) (*d_position_keys)[b][h].add_(position_partials[task]);
      }
    }
  });
}

}  // namespace

namespace linattn {

void vq_block_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                       const at::Tensor& codebook, const at::Tensor& window,
                       const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                       const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                       double scale, const at::Tensor& out, const at::Tensor& d_out, const at::Tensor& lse,
                       bool prev_grad, at::Tensor dq, at::Tensor dk, at::Tensor dv, at::Tensor d_first_k,
                       at::Tensor d_first_v, const c10::optional<at::Tensor>& d_codebook,
                       const c10::optional<at::Tensor>& d_window, const c10::optional<at::Tensor>& d_position_keys,
                       int64_t segment_blocks) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vq_block_backward", [&] {
    backward_rows<scalar_t>(q, k, v, prev_codes, codebook, window, position_keys, first_k, first_v, has_prev, counts,
                            sums, scale, out, d_out, lse, prev_grad, dq, dk, dv, d_first_k, d_first_v, d_codebook,
                            d_window, d_position_keys, segment_blocks);
  });
}

}  // namespace linattn
