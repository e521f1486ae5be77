// What the chunk kernels of kernel attention share (linear_scan.cpp, decayed_scan.cpp): the sizes
// of a call, the feature maps they make themselves, the division, and the gradients arriving.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

#include "fast_exp.h"
#include "native_checks.h"
#include "tile_products.h"

namespace linattn_native {

// The feature maps the kernel makes itself (kGiven: the inputs are the features).
enum FeatureMap : int64_t { kGiven = 0, kEluPlusOne = 1, kRelu = 2, kIdentity = 3 };

struct Sizes {
  int64_t N, G, T, F, E, C, chunks, segment_chunks, segments;
  int64_t first_chunk(int64_t segment) const { return segment * segment_chunks; }
  int64_t end_chunk(int64_t segment) const { return std::min(chunks, (segment + 1) * segment_chunks); }
  int64_t length(int64_t c) const { return std::min(C, T - c * C); }
};

// Everything a task reads: the sizes, the map and the division, the inputs (raw q and k) and, in
// the backward, the output, its denominator and the gradients arriving.
template <typename scalar_t>
struct Problem {
  Sizes s;
  int64_t map;
  scalar_t scale, eps;
  bool normalized, divide;
  const scalar_t *q, *k, *v;
  const scalar_t *out = nullptr, *den = nullptr, *d_out = nullptr, *d_den = nullptr;

  int64_t query_row(int64_t n, int64_t g, int64_t c) const { return (n * s.G + g) * s.T + c * s.C; }
  int64_t key_row(int64_t n, int64_t c) const { return n * s.T + c * s.C; }

  // phi(a x) of L rows of F, into `buffer`; the rows themselves when the map is given.
  const scalar_t* features(const scalar_t* raw, int64_t L, scalar_t a, scalar_t* buffer) const {
    if (map == kGiven) return raw;
    const int64_t count = L * s.F;
    for (int64_t i = 0; i < count; ++i) {
      const scalar_t x = raw[i] * a;
      if (map == kEluPlusOne)
        buffer[i] = x > 0 ? x + scalar_t(1) : linattn_native::exp_of(x);
      else if (map == kRelu)
        buffer[i] = x > 0 ? x : scalar_t(0);
      else
        buffer[i] = x;
    }
    return buffer;
  }
  const scalar_t* query_features(int64_t n, int64_t g, int64_t c, scalar_t* buffer) const {
    return features(q + query_row(n, g, c) * s.F, s.length(c), scale, buffer);
  }
  const scalar_t* key_features(int64_t n, int64_t c, scalar_t* buffer) const {
    return features(k + key_row(n, c) * s.F, s.length(c), scalar_t(1), buffer);
  }

  // grad *= phi'(a x) a over L rows of F: the gradient of the raw rows from the features'.
  void through_map(const scalar_t* raw, int64_t L, scalar_t a, scalar_t* grad) const {
    if (map == kGiven) return;
    const int64_t count = L * s.F;
    for (int64_t i = 0; i < count; ++i) {
      const scalar_t x = raw[i] * a;
      scalar_t slope = a;
      if (map == kEluPlusOne)
        slope = x > 0 ? a : linattn_native::exp_of(x) * a;
      else if (map == kRelu)
        slope = x > 0 ? a : scalar_t(0);
      grad[i] *= slope;
    }
  }

  // den[row + i] = reads_i . z + sum_{j <= i} scores[i, j] over the L rows of a chunk (reads [L, F]:
  // the query rows as they read the state entering it, z that state's normalizer, scores [L, L]),
  // and with the division out_i /= den_i + eps (out [L, E]).
  void denominators(int64_t row, int64_t L, const scalar_t* reads, const scalar_t* z, const scalar_t* scores,
                    scalar_t* den, scalar_t* out) const {
    for (int64_t i = 0; i < L; ++i) {
      scalar_t total = 0;
      for (int64_t f = 0; f < s.F; ++f) total += reads[i * s.F + f] * z[f];
      for (int64_t j = 0; j <= i; ++j) total += scores[i * L + j];
      den[row + i] = total;
      if (!divide) continue;
      const scalar_t inverse = scalar_t(1) / (total + eps);
      for (int64_t e = 0; e < s.E; ++e) out[i * s.E + e] *= inverse;
    }
  }

  // The gradients of num and den of query head g's rows of chunk c: d_out and d_den themselves, or
  // with the division dO = d_out / (den + eps), dd = -(d_out . out) / (den + eps) in the buffers.
  void output_gradients(int64_t n, int64_t g, int64_t c, scalar_t* dO_buffer, scalar_t* dd_buffer,
                        const scalar_t** dO, const scalar_t** dd) const {
    const int64_t row = query_row(n, g, c), L = s.length(c);
    if (!divide) {
      *dO = d_out + row * s.E;
      *dd = normalized ? d_den + row : nullptr;
      return;
    }
    for (int64_t i = 0; i < L; ++i) {
      const scalar_t inverse = scalar_t(1) / (den[row + i] + eps);
      const scalar_t* grad = d_out + (row + i) * s.E;
      const scalar_t* o = out + (row + i) * s.E;
      scalar_t dot = 0;
      for (int64_t e = 0; e < s.E; ++e) {
        dO_buffer[i * s.E + e] = grad[e] * inverse;
        dot += grad[e] * o[e];
      }
      dd_buffer[i] = -dot * inverse;
    }
    *dO = dO_buffer;
    *dd = dd_buffer;
  }
};

inline Sizes sizes_of(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& state, const c10::optional<at::Tensor>& normalizer, int64_t chunk,
               int64_t segment_chunks, int64_t map, double scale, bool divide) {
  TORCH_CHECK(q.dim() == 4, what, ": q must be [N, G, T, F], got ", q.sizes());
  TORCH_CHECK(v.dim() == 3, what, ": v must be [N, T, E], got ", v.sizes());
  TORCH_CHECK(chunk >= 1, what, ": chunk ", chunk, " < 1");
  TORCH_CHECK(segment_chunks >= 1, what, ": segment_chunks ", segment_chunks, " < 1");
  TORCH_CHECK(map >= kGiven && map <= kIdentity, what, ": feature_map ", map, " is not one of 0..3");
  TORCH_CHECK(!divide || normalizer.has_value(), what, ": the division needs a normalizer");
  TORCH_CHECK(map != kGiven || scale == 1.0, what, ": given features take no scale, got ", scale);
  Sizes s;
  s.N = q.size(0), s.G = q.size(1), s.T = q.size(2), s.F = q.size(3), s.E = v.size(2);
  s.C = chunk, s.segment_chunks = segment_chunks;
  s.chunks = (s.T + chunk - 1) / chunk;
  s.segments = std::max<int64_t>(1, (s.chunks + segment_chunks - 1) / segment_chunks);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, what, ": computes in float32 or float64, got ", dtype);
  check_tensor(what, q, "q", dtype, {s.N, s.G, s.T, s.F});
  check_tensor(what, k, "k", dtype, {s.N, s.T, s.F});
  check_tensor(what, v, "v", dtype, {s.N, s.T, s.E});
  check_tensor(what, state, "state", dtype, {s.N, s.F, s.E});
  if (normalizer.has_value()) check_tensor(what, *normalizer, "normalizer", dtype, {s.N, s.F});
  return s;
}

// z[f] += sum_j rows[j, f] over `count` rows of width F, in ascending j.
template <typename scalar_t>
void add_rows(int64_t count, int64_t F, const scalar_t* rows, scalar_t* z) {
  for (int64_t j = 0; j < count; ++j)
    for (int64_t f = 0; f < F; ++f) z[f] += rows[j * F + f];
}

// z[f] += sum_i rows[i, f] w[i] over `count` rows of width F, in ascending i.
template <typename scalar_t>
void add_weighted_rows(int64_t count, int64_t F, const scalar_t* rows, const scalar_t* w, scalar_t* z) {
  for (int64_t i = 0; i < count; ++i)
    for (int64_t f = 0; f < F; ++f) z[f] += rows[i * F + f] * w[i];
}

// Zero the entries of a square L x L tile above (kLower) or below (kUpper) its diagonal.
template <typename scalar_t>
void keep_triangle(Triangle triangle, int64_t L, scalar_t* tile) {
  for (int64_t i = 0; i < L; ++i) {
    if (triangle == Triangle::kLower)
      std::fill(tile + i * L + i + 1, tile + (i + 1) * L, scalar_t(0));
    else
      std::fill(tile + i * L, tile + i * L + i, scalar_t(0));
  }
}

// The outputs of a forward kernel fit its sizes: out [N, G, T, E], final_state [N, F, E] and, with a
// normalizer (and only with one), den [N, G, T] and final_normalizer [N, F].
inline void check_outputs(const char* what, const Sizes& s, at::ScalarType dtype, bool normalized,
                          const at::Tensor& out, const c10::optional<at::Tensor>& den, const at::Tensor& final_state,
                          const c10::optional<at::Tensor>& final_normalizer) {
  TORCH_CHECK(den.has_value() == normalized && final_normalizer.has_value() == normalized, what,
              ": den and final_normalizer go with a normalizer, and only with one");
  check_tensor(what, out, "out", dtype, {s.N, s.G, s.T, s.E});
  check_tensor(what, final_state, "final_state", dtype, {s.N, s.F, s.E});
  if (normalized) {
    check_tensor(what, *den, "den", dtype, {s.N, s.G, s.T});
    check_tensor(what, *final_normalizer, "final_normalizer", dtype, {s.N, s.F});
  }
}

template <typename scalar_t>
scalar_t* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<scalar_t>() : nullptr;
}

}  // namespace linattn_native
