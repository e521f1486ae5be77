// Causal kernel attention's chunk form, and its gradients (kernel/native_scan.py):
//
//   S_i = S_0 + sum_{j <= i} phi(k_j) v_j^T    z_i = z_0 + sum_{j <= i} phi(k_j)
//   num_i = phi(a q_i)^T S_i                   den_i = phi(a q_i) . z_i
//   out_i = num_i / (den_i + eps)  (divide)    or num_i (and den_i)
//
// per row n (a sequence's key/value head) and its G query heads, with phi given (the inputs are the
// features, a = 1), elu(x) + 1, relu(x) or x, made chunk by chunk in the core's cache. Per chunk of C positions, with
// the state S entering it: num_c = Q_c S + tril(Q_c K_c^T) V_c, then S += K_c^T V_c. A row is cut
// into segments of a fixed number of chunks; the state entering each segment is summed first (one
// product per chunk), then every (row, segment) is one task on one thread, so two threads share
// even a single row and the results do not depend on the thread count.
//
// Gradients (dO = d num, dd = d den): dq_i = dO_i S_i^T + dd_i z_i, by chunks forward from the
// segment's state; with D_c the gradient of the state after chunk c (d S_final plus q_i^T dO_i of
// every later position) and dz_c the normalizer's, backward over the chunks:
// dk_c = tril(dO_c V_c^T + dd_c 1^T)^T Q_c + V_c D_c^T + 1 dz_c^T and dv_c = tril(Q_c K_c^T)^T dO_c
// + K_c D_c; d S_0 and d z_0 are D and dz before the first chunk. With the division, dO_i = d out_i /
// (den_i + eps) and dd_i = -d out_i . out_i / (den_i + eps); the features' gradients go through
// phi'(a x) a.
#include "linear_scan.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "scan_problem.h"
#include "tile_products.h"

namespace {

using linattn_native::add_rows;
using linattn_native::add_weighted_rows;
using linattn_native::check_tensor;
using linattn_native::keep_triangle;
using linattn_native::Problem;
using linattn_native::Sizes;
using linattn_native::sizes_of;
using linattn_native::tile_product;
using linattn_native::transpose;
using linattn_native::Triangle;

// The state and normalizer entering every segment, [N, segments, F, E] and [N, segments, F]
// (seg_z null without a normalizer): the write sums of every segment but the last (one task
// each), then a running sum per row from S_0 and z_0.
template <typename scalar_t>
void segment_states(const Problem<scalar_t>& p, const scalar_t* S0, const scalar_t* z0, scalar_t* seg_S,
                    scalar_t* seg_z) {
  const Sizes& s = p.s;
  const int64_t FE = s.F * s.E, sums = s.segments - 1;
  at::parallel_for(0, s.N * sums, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> phi(s.C * s.F), kt(s.F * s.C);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / sums, segment = task % sums;
      scalar_t* W = seg_S + (n * s.segments + segment + 1) * FE;
      scalar_t* w = seg_z != nullptr ? seg_z + (n * s.segments + segment + 1) * s.F : nullptr;
      std::fill(W, W + FE, scalar_t(0));
      if (w != nullptr) std::fill(w, w + s.F, scalar_t(0));
      for (int64_t c = s.first_chunk(segment); c < s.end_chunk(segment); ++c) {
        const int64_t L = s.length(c);
        const scalar_t* kc = p.key_features(n, c, phi.data());
        transpose(L, s.F, kc, s.F, kt.data(), L);
        tile_product(s.F, s.E, L, kt.data(), L, p.v + p.key_row(n, c) * s.E, s.E, W, s.E, true);
        if (w != nullptr) add_rows(L, s.F, kc, w);
      }
    }
  });
  at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      scalar_t* row = seg_S + n * s.segments * FE;
      std::memcpy(row, S0 + n * FE, FE * sizeof(scalar_t));
      for (int64_t segment = 1; segment < s.segments; ++segment)
        for (int64_t i = 0; i < FE; ++i) row[segment * FE + i] += row[(segment - 1) * FE + i];
      if (seg_z == nullptr) continue;
      scalar_t* zrow = seg_z + n * s.segments * s.F;
      std::memcpy(zrow, z0 + n * s.F, s.F * sizeof(scalar_t));
      for (int64_t segment = 1; segment < s.segments; ++segment)
        for (int64_t f = 0; f < s.F; ++f) zrow[segment * s.F + f] += zrow[(segment - 1) * s.F + f];
    }
  });
}

template <typename scalar_t>
void forward_rows(const Problem<scalar_t>& p, const scalar_t* seg_S, const scalar_t* seg_z, scalar_t* out,
                  scalar_t* den, scalar_t* final_S, scalar_t* final_z) {
  const Sizes& s = p.s;
  const int64_t FE = s.F * s.E;
  at::parallel_for(0, s.N * s.segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> phi_k(s.C * s.F), phi_q(s.C * s.F), kt(s.F * s.C), scores(s.C * s.C), S(FE), z(s.F);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / s.segments, segment = task % s.segments;
      std::memcpy(S.data(), seg_S + task * FE, FE * sizeof(scalar_t));
      if (p.normalized) std::memcpy(z.data(), seg_z + task * s.F, s.F * sizeof(scalar_t));
      for (int64_t c = s.first_chunk(segment); c < s.end_chunk(segment); ++c) {
        const int64_t L = s.length(c);
        const scalar_t* kc = p.key_features(n, c, phi_k.data());
        const scalar_t* vc = p.v + p.key_row(n, c) * s.E;
        transpose(L, s.F, kc, s.F, kt.data(), L);
        for (int64_t g = 0; g < s.G; ++g) {
          const int64_t row = p.query_row(n, g, c);
          const scalar_t* qg = p.query_features(n, g, c, phi_q.data());
          tile_product(L, L, s.F, qg, s.F, kt.data(), L, scores.data(), L, false);
          keep_triangle(Triangle::kLower, L, scores.data());
          scalar_t* o = out + row * s.E;
          tile_product(L, s.E, s.F, qg, s.F, S.data(), s.E, o, s.E, false);
          tile_product(L, s.E, L, scores.data(), L, vc, s.E, o, s.E, true, Triangle::kLower);
          if (p.normalized) p.denominators(row, L, qg, z.data(), scores.data(), den, o);
        }
        tile_product(s.F, s.E, L, kt.data(), L, vc, s.E, S.data(), s.E, true);
        if (p.normalized) add_rows(L, s.F, kc, z.data());
      }
      if (segment == s.segments - 1) {
        std::memcpy(final_S + n * FE, S.data(), FE * sizeof(scalar_t));
        if (p.normalized) std::memcpy(final_z + n * s.F, z.data(), s.F * sizeof(scalar_t));
      }
    }
  });
}

// The gradient of the state (and normalizer) after every segment, [N, segments, F, E] and
// [N, segments, F]: q^T dO (and q^T dd) summed over each segment but the first (one task each),
// then a running sum per row from the end, from d S_final and d z_final (null: zero).
template <typename scalar_t>
void segment_gradients(const Problem<scalar_t>& p, const scalar_t* d_final_S, const scalar_t* d_final_z,
                       scalar_t* seg_D, scalar_t* seg_dz) {
  const Sizes& s = p.s;
  const int64_t FE = s.F * s.E, sums = s.segments - 1;
  at::parallel_for(0, s.N * sums, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> phi_q(s.C * s.F), qt(s.F * s.C), dO_buffer(s.C * s.E), dd_buffer(s.C);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / sums, segment = task % sums + 1;
      scalar_t* R = seg_D + (n * s.segments + segment - 1) * FE;
      scalar_t* r = p.normalized ? seg_dz + (n * s.segments + segment - 1) * s.F : nullptr;
      std::fill(R, R + FE, scalar_t(0));
      if (r != nullptr) std::fill(r, r + s.F, scalar_t(0));
      for (int64_t c = s.first_chunk(segment); c < s.end_chunk(segment); ++c) {
        const int64_t L = s.length(c);
        for (int64_t g = 0; g < s.G; ++g) {
          const scalar_t* qg = p.query_features(n, g, c, phi_q.data());
          const scalar_t *dO, *dd;
          p.output_gradients(n, g, c, dO_buffer.data(), dd_buffer.data(), &dO, &dd);
          transpose(L, s.F, qg, s.F, qt.data(), L);
          tile_product(s.F, s.E, L, qt.data(), L, dO, s.E, R, s.E, true);
          if (r != nullptr) add_weighted_rows(L, s.F, qg, dd, r);
        }
      }
    }
  });
  at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      scalar_t* row = seg_D + n * s.segments * FE;
      scalar_t* last = row + (s.segments - 1) * FE;
      if (d_final_S != nullptr)
        std::memcpy(last, d_final_S + n * FE, FE * sizeof(scalar_t));
      else
        std::fill(last, last + FE, scalar_t(0));
      for (int64_t segment = s.segments - 2; segment >= 0; --segment)
        for (int64_t i = 0; i < FE; ++i) row[segment * FE + i] += row[(segment + 1) * FE + i];
      if (seg_dz == nullptr) continue;
      scalar_t* zrow = seg_dz + n * s.segments * s.F;
      scalar_t* zlast = zrow + (s.segments - 1) * s.F;
      if (d_final_z != nullptr)
        std::memcpy(zlast, d_final_z + n * s.F, s.F * sizeof(scalar_t));
      else
        std::fill(zlast, zlast + s.F, scalar_t(0));
      for (int64_t segment = s.segments - 2; segment >= 0; --segment)
        for (int64_t f = 0; f < s.F; ++f) zrow[segment * s.F + f] += zrow[(segment + 1) * s.F + f];
    }
  });
}

template <typename scalar_t>
void backward_rows(const Problem<scalar_t>& p, const scalar_t* seg_S, const scalar_t* seg_z, const scalar_t* seg_D,
                   const scalar_t* seg_dz, scalar_t* dq, scalar_t* dk, scalar_t* dv, scalar_t* d_S0,
                   scalar_t* d_z0) {
  const Sizes& s = p.s;
  const int64_t FE = s.F * s.E;
  at::parallel_for(0, s.N * s.segments, 1, [&](int64_t begin, int64_t end) {
    std::vector<scalar_t> phi_k(s.C * s.F), phi_q(s.C * s.F), dO_buffer(s.C * s.E), dd_buffer(s.C);
    std::vector<scalar_t> vt(s.E * s.C), qt(s.F * s.C), dot(s.E * s.C), A(s.C * s.C), dA(s.C * s.C);
    std::vector<scalar_t> St(FE), z(s.F), D(FE), Dt(FE), dz(s.F);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / s.segments, segment = task % s.segments;
      // dq, forward over the segment's chunks from the state entering it
      transpose(s.F, s.E, seg_S + task * FE, s.E, St.data(), s.F);
      if (p.normalized) std::memcpy(z.data(), seg_z + task * s.F, s.F * sizeof(scalar_t));
      for (int64_t c = s.first_chunk(segment); c < s.end_chunk(segment); ++c) {
        const int64_t L = s.length(c);
        const scalar_t* kc = p.key_features(n, c, phi_k.data());
        transpose(L, s.E, p.v + p.key_row(n, c) * s.E, s.E, vt.data(), L);
        for (int64_t g = 0; g < s.G; ++g) {
          const int64_t row = p.query_row(n, g, c);
          const scalar_t *dO, *dd;
          p.output_gradients(n, g, c, dO_buffer.data(), dd_buffer.data(), &dO, &dd);
          scalar_t* dqg = dq + row * s.F;
          tile_product(L, L, s.E, dO, s.E, vt.data(), L, dA.data(), L, false);
          if (p.normalized)
            for (int64_t i = 0; i < L; ++i)
              for (int64_t j = 0; j <= i; ++j) dA[i * L + j] += dd[i];
          keep_triangle(Triangle::kLower, L, dA.data());
          tile_product(L, s.F, s.E, dO, s.E, St.data(), s.F, dqg, s.F, false);
          if (p.normalized)
            for (int64_t i = 0; i < L; ++i)
              for (int64_t f = 0; f < s.F; ++f) dqg[i * s.F + f] += dd[i] * z[f];
          tile_product(L, s.F, L, dA.data(), L, kc, s.F, dqg, s.F, true, Triangle::kLower);
          p.through_map(p.q + row * s.F, L, p.scale, dqg);
        }
        tile_product(s.E, s.F, L, vt.data(), L, kc, s.F, St.data(), s.F, true);
        if (p.normalized) add_rows(L, s.F, kc, z.data());
      }
      // dk and dv, backward over the segment's chunks from the gradient of the state after it
      std::memcpy(D.data(), seg_D + task * FE, FE * sizeof(scalar_t));
      transpose(s.F, s.E, D.data(), s.E, Dt.data(), s.F);
      if (p.normalized) std::memcpy(dz.data(), seg_dz + task * s.F, s.F * sizeof(scalar_t));
      for (int64_t c = s.end_chunk(segment) - 1; c >= s.first_chunk(segment); --c) {
        const int64_t L = s.length(c), key_row = p.key_row(n, c);
        const scalar_t* kc = p.key_features(n, c, phi_k.data());
        const scalar_t* vc = p.v + key_row * s.E;
        scalar_t* dkc = dk + key_row * s.F;
        scalar_t* dvc = dv + key_row * s.E;
        tile_product(L, s.F, s.E, vc, s.E, Dt.data(), s.F, dkc, s.F, false);
        if (p.normalized)
          for (int64_t j = 0; j < L; ++j)
            for (int64_t f = 0; f < s.F; ++f) dkc[j * s.F + f] += dz[f];
        tile_product(L, s.E, s.F, kc, s.F, D.data(), s.E, dvc, s.E, false);
        for (int64_t g = 0; g < s.G; ++g) {
          const scalar_t* qg = p.query_features(n, g, c, phi_q.data());
          const scalar_t *dO, *dd;
          p.output_gradients(n, g, c, dO_buffer.data(), dd_buffer.data(), &dO, &dd);
          transpose(L, s.F, qg, s.F, qt.data(), L);
          transpose(L, s.E, dO, s.E, dot.data(), L);
          tile_product(L, L, s.F, kc, s.F, qt.data(), L, A.data(), L, false);  // A^T: phi(k_j) . phi(q_i)
          keep_triangle(Triangle::kUpper, L, A.data());
          tile_product(L, L, s.E, vc, s.E, dot.data(), L, dA.data(), L, false);  // dA^T: v_j . dO_i
          if (p.normalized)
            for (int64_t j = 0; j < L; ++j)
              for (int64_t i = j; i < L; ++i) dA[j * L + i] += dd[i];
          keep_triangle(Triangle::kUpper, L, dA.data());
          tile_product(L, s.F, L, dA.data(), L, qg, s.F, dkc, s.F, true, Triangle::kUpper);
          tile_product(L, s.E, L, A.data(), L, dO, s.E, dvc, s.E, true, Triangle::kUpper);
          tile_product(s.F, s.E, L, qt.data(), L, dO, s.E, D.data(), s.E, true);
          if (p.normalized) add_weighted_rows(L, s.F, qg, dd, dz.data());
        }
        p.through_map(p.k + key_row * s.F, L, scalar_t(1), dkc);
        transpose(s.F, s.E, D.data(), s.E, Dt.data(), s.F);
      }
      if (segment == 0) {
        std::memcpy(d_S0 + n * FE, D.data(), FE * sizeof(scalar_t));
        if (p.normalized) std::memcpy(d_z0 + n * s.F, dz.data(), s.F * sizeof(scalar_t));
      }
    }
  });
}

}  // namespace

namespace linattn {

void linear_scan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
                         const c10::optional<at::Tensor>& normalizer, int64_t chunk, int64_t segment_chunks,
                         int64_t feature_map, double scale, bool divide, double eps, at::Tensor out,
                         const c10::optional<at::Tensor>& den, at::Tensor final_state,
                         const c10::optional<at::Tensor>& final_normalizer) {
  const char* what = "linear scan (native)";
  const Sizes s = sizes_of(what, q, k, v, state, normalizer, chunk, segment_chunks, feature_map, scale, divide);
  const auto dtype = q.scalar_type();
  const bool normalized = normalizer.has_value();
  linattn_native::check_outputs(what, s, dtype, normalized, out, den, final_state, final_normalizer);
  at::Tensor seg_S = at::empty({s.N, s.segments, s.F, s.E}, q.options());
  c10::optional<at::Tensor> seg_z;
  if (normalized) seg_z = at::empty({s.N, s.segments, s.F}, q.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "linear_scan_forward", [&] {
    const Problem<scalar_t> p{s, feature_map, static_cast<scalar_t>(scale), static_cast<scalar_t>(eps), normalized,
                              divide, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    segment_states<scalar_t>(p, state.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(normalizer),
                             seg_S.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(seg_z));
    forward_rows<scalar_t>(p, seg_S.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(seg_z), out.data_ptr<scalar_t>(),
                           linattn_native::data_or_null<scalar_t>(den), final_state.data_ptr<scalar_t>(),
                           linattn_native::data_or_null<scalar_t>(final_normalizer));
  });
}

void linear_scan_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& state,
                          const c10::optional<at::Tensor>& normalizer, const c10::optional<at::Tensor>& out,
                          const c10::optional<at::Tensor>& den, const at::Tensor& d_out,
                          const c10::optional<at::Tensor>& d_den, const c10::optional<at::Tensor>& d_final_state,
                          const c10::optional<at::Tensor>& d_final_normalizer, int64_t chunk, int64_t segment_chunks,
                          int64_t feature_map, double scale, bool divide, double eps, at::Tensor dq, at::Tensor dk,
                          at::Tensor dv, at::Tensor d_state, const c10::optional<at::Tensor>& d_normalizer) {
  const char* what = "linear scan backward (native)";
  const Sizes s = sizes_of(what, q, k, v, state, normalizer, chunk, segment_chunks, feature_map, scale, divide);
  const auto dtype = q.scalar_type();
  const bool normalized = normalizer.has_value();
  TORCH_CHECK(d_normalizer.has_value() == normalized, what, ": d_normalizer goes with a normalizer, and only with one");
  TORCH_CHECK(!d_final_normalizer.has_value() || normalized, what, ": d_final_normalizer without a normalizer");
  TORCH_CHECK(divide ? (out.has_value() && den.has_value() && !d_den.has_value())
                     : (d_den.has_value() == normalized), what,
              ": with the division the output and its denominator (not d_den), without it d_den with a normalizer");
  check_tensor(what, d_out, "d_out", dtype, {s.N, s.G, s.T, s.E});
  if (divide) {
    check_tensor(what, *out, "out", dtype, {s.N, s.G, s.T, s.E});
    check_tensor(what, *den, "den", dtype, {s.N, s.G, s.T});
  }
  if (d_den.has_value()) check_tensor(what, *d_den, "d_den", dtype, {s.N, s.G, s.T});
  if (d_final_state.has_value()) check_tensor(what, *d_final_state, "d_final_state", dtype, {s.N, s.F, s.E});
  if (d_final_normalizer.has_value())
    check_tensor(what, *d_final_normalizer, "d_final_normalizer", dtype, {s.N, s.F});
  check_tensor(what, dq, "dq", dtype, {s.N, s.G, s.T, s.F});
  check_tensor(what, dk, "dk", dtype, {s.N, s.T, s.F});
  check_tensor(what, dv, "dv", dtype, {s.N, s.T, s.E});
  check_tensor(what, d_state, "d_state", dtype, {s.N, s.F, s.E});
  if (normalized) check_tensor(what, *d_normalizer, "d_normalizer", dtype, {s.N, s.F});
  at::Tensor seg_S = at::empty({s.N, s.segments, s.F, s.E}, q.options());
  at::Tensor seg_D = at::empty({s.N, s.segments, s.F, s.E}, q.options());
  c10::optional<at::Tensor> seg_z, seg_dz;
  if (normalized) {
    seg_z = at::empty({s.N, s.segments, s.F}, q.options());
    seg_dz = at::empty({s.N, s.segments, s.F}, q.options());
  }
  AT_DISPATCH_FLOATING_TYPES(dtype, "linear_scan_backward", [&] {
    Problem<scalar_t> p{s, feature_map, static_cast<scalar_t>(scale), static_cast<scalar_t>(eps), normalized,
                        divide, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    p.out = linattn_native::data_or_null<scalar_t>(out);
    p.den = linattn_native::data_or_null<scalar_t>(den);
    p.d_out = d_out.data_ptr<scalar_t>();
    p.d_den = linattn_native::data_or_null<scalar_t>(d_den);
    segment_states<scalar_t>(p, state.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(normalizer),
                             seg_S.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(seg_z));
    segment_gradients<scalar_t>(p, linattn_native::data_or_null<scalar_t>(d_final_state), linattn_native::data_or_null<scalar_t>(d_final_normalizer),
                                seg_D.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(seg_dz));
    backward_rows<scalar_t>(p, seg_S.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(seg_z), seg_D.data_ptr<scalar_t>(),
                            linattn_native::data_or_null<scalar_t>(seg_dz), dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(),
                            dv.data_ptr<scalar_t>(), d_state.data_ptr<scalar_t>(), linattn_native::data_or_null<scalar_t>(d_normalizer));
  });
}

}  // namespace linattn
