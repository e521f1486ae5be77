// Transformer-VQ's causal block form without gradients, for hard codes, fused per block.
//
// The same computation as ops/vq/running.py (running_blocks) for CPU tensors in float32 or
// float64, one (batch, kv head) row per task of at::parallel_for (a row is computed by one
// thread from start to end, so results do not depend on the thread count). Per row, blocks
// r = 0 .. R-1 in order, with the row's cache (counts n_s, sums u_s) carried from block to block,
// for queries q not yet scaled:
//
//   x       = scale Q_r [K_{r-1}; K_r]^T + bias + scale band   [L, 2L]   (the window)
//   y       = scale Q_r C^T + log n                              [L, S]    (the cache; C the codebook)
//   out_r   = softmax([x | y]) [V_{r-1}; V_r; u / n]             [L, Dv]
//
// computed per block as: the scores Q_r [K_{r-1}; K_r; C]^T by one product (the codebook lives in
// the keys buffer's last S rows); one pass per row adds the bias, the band and log n, takes the
// row's maximum and writes exp(x - top) and exp(scale q.c_s - top)
// (= exp(y_s - top) / n_s; an empty slot, n_s = 0, gets -inf before the exp, so 0 however high
// its score) with the row's total; one product with the values
// [V_{r-1}; V_r; u] (u, the cache's sums, live in that buffer and are updated in place) and the
// output rows divided by their totals. Then block r - 1 enters the cache: n_{z_j} += 1,
// u_{z_j} += v_j for its positions j.
//
// band: q_a . P_delta at offset delta = L + a - c of query row a and window column c, for
// 0 <= delta <= L (one product Q_r P^T [L, L + 1] per block and query group), when position
// keys P are given. Block 0's previous block is the carried one (has_prev) or none (its
// columns get -inf). The cache before block full_blocks is the call's final cache. The float32
// exp is vectorisable (range reduction and a degree-6 polynomial, relative error below 2e-7);
// float64 uses std::exp.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

// exp(x) for a float, written so that loops over it vectorise (no calls, no branches):
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor polynomial of degree 6 (Horner),
// 2^n by the exponent bits. Arguments below -87.3 (and -inf) give 0, above 88.7 give inf.
inline float fast_exp(float x) {
  const float clamped = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
  // round to nearest by adding and subtracting 1.5 * 2^23 (|x log2 e| < 2^22): vectorises, unlike a call
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (clamped - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  const float y = p * scale;
  return x < -87.3f ? 0.0f : (x > 88.7f ? std::numeric_limits<float>::infinity() : y);
}

inline float exp_of(float x) { return fast_exp(x); }
inline double exp_of(double x) { return std::exp(x); }

void check(const at::Tensor& t, const char* name, at::ScalarType dtype, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, "vq block form (native): ", name, " has shape ", t.sizes(), ", expected ", shape);
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == dtype, "vq block form (native): ", name,
              " must be a contiguous CPU tensor of ", dtype, ", got ", t.scalar_type(), " on ", t.device(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

// One softmax per score row of a block over [window (2L) | cache (S)] columns, in place, for
// scores q.k not yet scaled: the window's scale q.k + bias (the bias has -inf above the
// diagonal) + scale band (band [L, L + 1], q_a . P_delta, or null), the cache's
// scale q.c_s + log n_s. What is stored: exp(x - top) on the window, and on the cache
// exp(scale q.c_s - top) = exp(x_s - top) / n_s (0 where n_s = 0), so that the product with
// [window values; cache sums] is the output times the row's total; totals[a] gets 1 / total.
template <typename T>
void block_softmax(T* scores, int64_t L, int64_t S, T scale, const T* bias, const T* band, bool without_prev,
                   const T* counts, const T* log_counts, T* totals) {
  const int64_t W = 2 * L, C = W + S;
  const T minus_inf = -std::numeric_limits<T>::infinity();
  for (int64_t a = 0; a < L; ++a) {
    T* row = scores + a * C;
    const T* bias_row = bias + a * W;
    const int64_t first = without_prev ? L : 0;  // block 0 without a previous block: its columns get -inf
    for (int64_t c = 0; c < first; ++c) row[c] = minus_inf;
    T top = minus_inf;
#pragma omp simd reduction(max : top)
    for (int64_t c = first; c < W; ++c) {
      row[c] = scale * row[c] + bias_row[c];
      top = row[c] > top ? row[c] : top;
    }
    if (band != nullptr) {  // columns c = a .. a + L: delta = L + a - c runs L .. 0
      const T* band_row = band + a * (L + 1) + L + a;
      top = minus_inf;
      for (int64_t c = first > a ? first : a; c <= a + L; ++c) row[c] += scale * band_row[-c];
#pragma omp simd reduction(max : top)
      for (int64_t c = first; c < W; ++c) top = row[c] > top ? row[c] : top;
    }
    T* cache = row + W;
#pragma omp simd reduction(max : top)
    for (int64_t s = 0; s < S; ++s) {
      const T x = scale * cache[s];
      cache[s] = log_counts[s] == minus_inf ? minus_inf : x;  // an empty slot: weight 0, however high x
      const T y = x + log_counts[s];
      top = y > top ? y : top;
    }
    T total = 0;
#pragma omp simd reduction(+ : total)
    for (int64_t c = 0; c < W; ++c) {
      const T e = exp_of(row[c] - top);
      row[c] = e;
      total += e;
    }
#pragma omp simd reduction(+ : total)
    for (int64_t s = 0; s < S; ++s) {
      const T e = exp_of(cache[s] - top);
      cache[s] = e;
      total += e * counts[s];
    }
    totals[a] = T(1) / total;
  }
}

template <typename T>
void block_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                const at::Tensor& codebook, const at::Tensor& window,
                const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k, const at::Tensor& first_v,
                bool has_prev, const at::Tensor& counts, const at::Tensor& sums, int64_t full_blocks, double scale,
                at::Tensor& out, at::Tensor& final_counts, at::Tensor& final_sums) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 6 && codebook.dim() == 3 && window.dim() == 4,
              "vq block form (native): q [B, Hkv, G, R, L, Dk], codebook [Hkv, S, Dk], window [Hkv|1, G|1, L, 2L]");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), R = q.size(3), L = q.size(4), Dk = q.size(5);
  const int64_t S = codebook.size(1), Dv = v.size(-1), W = 2 * L, C = W + S;
  const int64_t Wh = window.size(0), Wg = window.size(1);
  TORCH_CHECK((Wh == 1 || Wh == Hkv) && (Wg == 1 || Wg == G), "vq block form (native): window has shape ",
              window.sizes(), " for Hkv = ", Hkv, ", G = ", G);
  TORCH_CHECK(full_blocks >= 0 && full_blocks <= R, "vq block form (native): full_blocks ", full_blocks,
              " outside [0, ", R, "]");
  check(q, "q", dtype, {B, Hkv, G, R, L, Dk});
  check(k, "k", dtype, {B, Hkv, R, L, Dk});
  check(v, "v", dtype, {B, Hkv, R, L, Dv});
  check(prev_codes, "prev_codes", at::kLong, {B, Hkv, R, L});
  check(codebook, "codebook", dtype, {Hkv, S, Dk});
  check(window, "window", dtype, {Wh, Wg, L, W});
  int64_t Ph = 1, Pg = 1;
  if (position_keys.has_value()) {
    const at::Tensor& P = *position_keys;
    TORCH_CHECK(P.dim() == 4 && (P.size(0) == 1 || P.size(0) == Hkv) && (P.size(1) == 1 || P.size(1) == G),
                "vq block form (native): position_keys has shape ", P.sizes(), ", expected [Hkv|1, G|1, L + 1, Dk]");
    Ph = P.size(0), Pg = P.size(1);
    check(P, "position_keys", dtype, {Ph, Pg, L + 1, Dk});
  }
  check(first_k, "first_k", dtype, {B, Hkv, L, Dk});
  check(first_v, "first_v", dtype, {B, Hkv, L, Dv});
  check(counts, "counts", dtype, {B, Hkv, S});
  check(sums, "sums", dtype, {B, Hkv, S, Dv});
  check(out, "out", dtype, {B, Hkv, G, R, L, Dv});
  check(final_counts, "final_counts", dtype, {B, Hkv, S});
  check(final_sums, "final_sums", dtype, {B, Hkv, S, Dv});
  const int64_t* code_data = prev_codes.data_ptr<int64_t>();
  for (int64_t i = 0, n = prev_codes.numel(); i < n; ++i)
    TORCH_CHECK(code_data[i] >= 0 && code_data[i] < S, "vq block form (native): code ", code_data[i],
                " outside [0, ", S, ")");
  const auto options = q.options();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    at::Tensor scores = at::empty({L, C}, options), band = at::empty({L, L + 1}, options);
    at::Tensor keys = at::empty({C, Dk}, options), values = at::empty({C, Dv}, options);
    std::vector<T> row_counts(S), log_counts(S), totals(L);
    T* key_data = keys.data_ptr<T>();
    T* value_data = values.data_ptr<T>();
    T* cache_sums = value_data + W * Dv;  // the cache's sums live in the values' last S rows
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv;
      std::memcpy(key_data + W * Dk, codebook.data_ptr<T>() + h * S * Dk, S * Dk * sizeof(T));  // the keys' last S rows
      std::memcpy(row_counts.data(), counts.data_ptr<T>() + bh * S, S * sizeof(T));
      std::memcpy(cache_sums, sums.data_ptr<T>() + bh * S * Dv, S * Dv * sizeof(T));
      const T* k_row = k.data_ptr<T>() + bh * R * L * Dk;
      const T* v_row = v.data_ptr<T>() + bh * R * L * Dv;
      const int64_t* codes_row = code_data + bh * R * L;
      std::vector<at::Tensor> q_rows, out_rows, position_rows;  // per query group: [R L, Dk], [R L, Dv], P^T
      for (int64_t g = 0; g < G; ++g) {
        q_rows.push_back(q[b][h][g].view({R * L, Dk}));
        out_rows.push_back(out[b][h][g].view({R * L, Dv}));
        if (position_keys.has_value()) position_rows.push_back((*position_keys)[Ph == 1 ? 0 : h][Pg == 1 ? 0 : g].t());
      }
      for (int64_t r = 0; r < R; ++r) {
        if (r == full_blocks) {
          std::memcpy(final_counts.data_ptr<T>() + bh * S, row_counts.data(), S * sizeof(T));
          std::memcpy(final_sums.data_ptr<T>() + bh * S * Dv, cache_sums, S * Dv * sizeof(T));
        }
        const T* prev_k = r > 0 ? k_row + (r - 1) * L * Dk : first_k.data_ptr<T>() + bh * L * Dk;
        const T* prev_v = r > 0 ? v_row + (r - 1) * L * Dv : first_v.data_ptr<T>() + bh * L * Dv;
        std::memcpy(key_data, prev_k, L * Dk * sizeof(T));
        std::memcpy(key_data + L * Dk, k_row + r * L * Dk, L * Dk * sizeof(T));
        std::memcpy(value_data, prev_v, L * Dv * sizeof(T));
        std::memcpy(value_data + L * Dv, v_row + r * L * Dv, L * Dv * sizeof(T));
        for (int64_t s = 0; s < S; ++s) {
          const T n = row_counts[s];
          log_counts[s] = n == 0 ? -std::numeric_limits<T>::infinity() : std::log(n);
        }
        const bool without_prev = r == 0 && !has_prev;
        for (int64_t g = 0; g < G; ++g) {
          const at::Tensor q_block = q_rows[g].narrow(0, r * L, L);
          at::mm_out(scores, q_block, keys.t());
          const T* bias = window.data_ptr<T>() + ((Wh == 1 ? 0 : h) * Wg + (Wg == 1 ? 0 : g)) * L * W;
          const T* band_data = nullptr;
          if (position_keys.has_value()) {
            at::mm_out(band, q_block, position_rows[g]);
            band_data = band.data_ptr<T>();
          }
          block_softmax<T>(scores.data_ptr<T>(), L, S, static_cast<T>(scale), bias, band_data, without_prev,
                           row_counts.data(), log_counts.data(), totals.data());
          at::Tensor out_block = out_rows[g].narrow(0, r * L, L);
          at::mm_out(out_block, scores, values);
          T* o = out_block.data_ptr<T>();
          for (int64_t a = 0; a < L; ++a) {
            const T inverse = totals[a];
#pragma omp simd
            for (int64_t e = 0; e < Dv; ++e) o[a * Dv + e] *= inverse;
          }
        }
        if (!without_prev) {  // block r's previous block enters the cache
          const int64_t* entering = codes_row + r * L;
          for (int64_t j = 0; j < L; ++j) {
            const int64_t z = entering[j];
            row_counts[z] += 1;
            T* u = cache_sums + z * Dv;
            const T* value = prev_v + j * Dv;
            for (int64_t e = 0; e < Dv; ++e) u[e] += value[e];
          }
        }
      }
      if (full_blocks == R) {
        std::memcpy(final_counts.data_ptr<T>() + bh * S, row_counts.data(), S * sizeof(T));
        std::memcpy(final_sums.data_ptr<T>() + bh * S * Dv, cache_sums, S * Dv * sizeof(T));
      }
    }
  });
}

}  // namespace

namespace linattn {

void vq_block_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& prev_codes,
                      const at::Tensor& codebook, const at::Tensor& window,
                      const c10::optional<at::Tensor>& position_keys, const at::Tensor& first_k,
                      const at::Tensor& first_v, bool has_prev, const at::Tensor& counts, const at::Tensor& sums,
                      int64_t full_blocks, double scale, at::Tensor out, at::Tensor final_counts,
                      at::Tensor final_sums) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vq_block_forward", [&] {
    block_rows<scalar_t>(q, k, v, prev_codes, codebook, window, position_keys, first_k, first_v, has_prev, counts,
                         sums, full_blocks, scale, out, final_counts, final_sums);
  });
}

}  // namespace linattn
