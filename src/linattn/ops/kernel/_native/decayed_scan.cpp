// Causal kernel attention with decay, its chunk form without gradients (kernel/native_scan.py):
//
//   S_t = diag(exp(g_t)) S_{t-1} + phi(k_t) v_t^T    z_t = exp(g_t) * z_{t-1} + phi(k_t)
//   out_t = phi(a q_t)^T S_t [/ (phi(a q_t) . z_t + eps)]
//
// with log decays g_t <= 0 (-inf resets) per step (Fg = 1) or per feature channel (Fg = F). Per
// chunk of C positions, with P_i = sum_{m <= i} g_m and E_j = sum_{m > j} g_m inside the chunk and
// L_ij = sum_{j < m <= i} g_m:
//
//   out_c = (phi(Q_c) * exp(P)) S + A_c V_c,   A_ij = sum_f phi(q_i)_f phi(k_j)_f exp(L_ijf)  (j <= i)
//   S <- exp(P_{C-1}) * S + (phi(K_c) * exp(E))^T V_c
//
// Every exponent is a sum of decays (never a difference), so each factor is at most 1 and a reset
// (-inf) gives 0, not NaN; chunk_decays.h has these terms. Per channel, A is built pair by pair, L_ij
// summed from i down to j; with one decay per step, A = (Q K^T) * exp(L). A row is cut into segments
// as in linear_scan.cpp: the
// state entering each is summed first (each segment's writes decayed to its end, and its total
// decay), then every (row, segment) is one task.
#include "linear_scan.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "chunk_decays.h"
#include "scan_problem.h"
#include "tile_products.h"

namespace {

using linattn_native::add_rows;
using linattn_native::check_tensor;
using linattn_native::data_or_null;
using linattn_native::decay_at;
using linattn_native::decay_rows;
using linattn_native::exp_of;
using linattn_native::Problem;
using linattn_native::Sizes;
using linattn_native::tile_product;
using linattn_native::transpose;
using linattn_native::Triangle;

// A task's buffers, and the chunk computation on them.
template <typename scalar_t>
struct DecayedChunks {
  const Problem<scalar_t>& p;
  const scalar_t* g;  // [N, T, Fg]
  int64_t Fg;
  std::vector<scalar_t> phi_k, phi_q, reads, writes, writes_t, scores, prefix, suffix, run;

  DecayedChunks(const Problem<scalar_t>& problem, const scalar_t* decays, int64_t channels)
      : p(problem), g(decays), Fg(channels) {
    const Sizes& s = p.s;
    phi_k.resize(s.C * s.F), phi_q.resize(s.C * s.F), reads.resize(s.C * s.F), writes.resize(s.C * s.F);
    writes_t.resize(s.F * s.C), scores.resize(s.C * s.C), prefix.resize(s.C * Fg), suffix.resize(s.C * Fg);
    run.resize(Fg);
  }

  // Chunk c of row n: the outputs (when `out` is not null) and the state S [F, E] and normalizer z
  // [F] (null without one) carried through it; `total` [Fg] gains the chunk's decay sum.
  void chunk(int64_t n, int64_t c, scalar_t* S, scalar_t* z, scalar_t* out, scalar_t* den, scalar_t* total) {
    const Sizes& s = p.s;
    const int64_t L = s.length(c), key_row = p.key_row(n, c);
    const scalar_t* gc = g + key_row * Fg;
    linattn_native::decay_sums(gc, L, Fg, run.data(), prefix.data(), suffix.data());
    const scalar_t* kc = p.key_features(n, c, phi_k.data());
    const scalar_t* vc = p.v + key_row * s.E;
    if (out != nullptr) {
      if (Fg == 1) transpose(L, s.F, kc, s.F, writes_t.data(), L);  // K^T for the scores
      for (int64_t h = 0; h < s.G; ++h) outputs(n, h, c, L, kc, vc, gc, S, z, out, den);
    }
    for (int64_t f = 0; f < s.F; ++f) {  // the state decays by the chunk's sum, then takes its writes
      const scalar_t a = exp_of(decay_at(prefix.data(), Fg, L - 1, f));
      for (int64_t e = 0; e < s.E; ++e) S[f * s.E + e] *= a;
      if (z != nullptr) z[f] *= a;
    }
    decay_rows(kc, L, s.F, suffix.data(), Fg, writes.data());
    transpose(L, s.F, writes.data(), s.F, writes_t.data(), L);
    tile_product(s.F, s.E, L, writes_t.data(), L, vc, s.E, S, s.E, true);
    if (z != nullptr) add_rows(L, s.F, writes.data(), z);
    for (int64_t f = 0; f < Fg; ++f) total[f] += prefix[(L - 1) * Fg + f];
  }

  void outputs(int64_t n, int64_t h, int64_t c, int64_t L, const scalar_t* kc, const scalar_t* vc, const scalar_t* gc,
               const scalar_t* S, const scalar_t* z, scalar_t* out, scalar_t* den) {
    const Sizes& s = p.s;
    const int64_t row = p.query_row(n, h, c);
    const scalar_t* qh = p.query_features(n, h, c, phi_q.data());
    decay_rows(qh, L, s.F, prefix.data(), Fg, reads.data());
    scalar_t* o = out + row * s.E;
    tile_product(L, s.E, s.F, reads.data(), s.F, S, s.E, o, s.E, false);
    linattn_native::decayed_scores(L, s.F, Fg, qh, kc, writes_t.data(), gc, false, run.data(), scores.data());
    tile_product(L, s.E, L, scores.data(), L, vc, s.E, o, s.E, true, Triangle::kLower);
    if (p.normalized) p.denominators(row, L, reads.data(), z, scores.data(), den, o);
  }
};

template <typename scalar_t>
void decayed_rows(const Problem<scalar_t>& p, const scalar_t* g, int64_t Fg, const scalar_t* S0, const scalar_t* z0,
                  scalar_t* out, scalar_t* den, scalar_t* final_S, scalar_t* final_z) {
  const Sizes& s = p.s;
  const int64_t FE = s.F * s.E, sums = s.segments - 1;
  std::vector<scalar_t> seg_S(s.N * s.segments * FE), seg_z(p.normalized ? s.N * s.segments * s.F : 0);
  std::vector<scalar_t> seg_decay(s.N * s.segments * Fg, scalar_t(0));  // log decay of each segment
  // every segment but the last from a zero state: its writes decayed to its end, and its decay
  at::parallel_for(0, s.N * sums, 1, [&](int64_t begin, int64_t end) {
    DecayedChunks<scalar_t> chunks(p, g, Fg);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / sums, segment = task % sums;
      const int64_t slot = n * s.segments + segment + 1;
      scalar_t* W = seg_S.data() + slot * FE;
      scalar_t* w = p.normalized ? seg_z.data() + slot * s.F : nullptr;
      std::fill(W, W + FE, scalar_t(0));
      if (w != nullptr) std::fill(w, w + s.F, scalar_t(0));
      for (int64_t c = s.first_chunk(segment); c < s.end_chunk(segment); ++c)
        chunks.chunk(n, c, W, w, nullptr, nullptr, seg_decay.data() + slot * Fg);
    }
  });
  // the state entering each segment: S_{s+1} = exp(decay_s) * S_s + W_s
  at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      scalar_t* row = seg_S.data() + n * s.segments * FE;
      scalar_t* zrow = p.normalized ? seg_z.data() + n * s.segments * s.F : nullptr;
      std::memcpy(row, S0 + n * FE, FE * sizeof(scalar_t));
      if (zrow != nullptr) std::memcpy(zrow, z0 + n * s.F, s.F * sizeof(scalar_t));
      for (int64_t segment = 1; segment < s.segments; ++segment) {
        const scalar_t* decay = seg_decay.data() + (n * s.segments + segment) * Fg;
        for (int64_t f = 0; f < s.F; ++f) {
          const scalar_t a = exp_of(decay_at(decay, Fg, 0, f));
          for (int64_t e = 0; e < s.E; ++e)
            row[segment * FE + f * s.E + e] += a * row[(segment - 1) * FE + f * s.E + e];
          if (zrow != nullptr) zrow[segment * s.F + f] += a * zrow[(segment - 1) * s.F + f];
        }
      }
    }
  });
  at::parallel_for(0, s.N * s.segments, 1, [&](int64_t begin, int64_t end) {
    DecayedChunks<scalar_t> chunks(p, g, Fg);
    std::vector<scalar_t> S(FE), z(s.F), total(Fg);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / s.segments, segment = task % s.segments;
      std::memcpy(S.data(), seg_S.data() + task * FE, FE * sizeof(scalar_t));
      if (p.normalized) std::memcpy(z.data(), seg_z.data() + task * s.F, s.F * sizeof(scalar_t));
      for (int64_t c = s.first_chunk(segment); c < s.end_chunk(segment); ++c)
        chunks.chunk(n, c, S.data(), p.normalized ? z.data() : nullptr, out, den, total.data());
      if (segment == s.segments - 1) {
        std::memcpy(final_S + n * FE, S.data(), FE * sizeof(scalar_t));
        if (p.normalized) std::memcpy(final_z + n * s.F, z.data(), s.F * sizeof(scalar_t));
      }
    }
  });
}

}  // namespace

namespace linattn {

void decayed_scan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& state, const c10::optional<at::Tensor>& normalizer, int64_t chunk,
                          int64_t segment_chunks, int64_t feature_map, double scale, bool divide, double eps,
                          at::Tensor out, const c10::optional<at::Tensor>& den, at::Tensor final_state,
                          const c10::optional<at::Tensor>& final_normalizer) {
  const char* what = "decayed linear scan (native)";
  const Sizes s = linattn_native::sizes_of(what, q, k, v, state, normalizer, chunk, segment_chunks, feature_map, scale,
                                           divide);
  const auto dtype = q.scalar_type();
  const bool normalized = normalizer.has_value();
  TORCH_CHECK(g.dim() == 3 && (g.size(2) == 1 || g.size(2) == s.F), what, ": g must be [N, T, 1] or [N, T, ", s.F,
              "], got ", g.sizes());
  const int64_t Fg = g.size(2);
  check_tensor(what, g, "g", dtype, {s.N, s.T, Fg});
  linattn_native::check_outputs(what, s, dtype, normalized, out, den, final_state, final_normalizer);
  AT_DISPATCH_FLOATING_TYPES(dtype, "decayed_scan_forward", [&] {
    const Problem<scalar_t> p{s, feature_map, static_cast<scalar_t>(scale), static_cast<scalar_t>(eps), normalized,
                              divide, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>()};
    decayed_rows<scalar_t>(p, g.data_ptr<scalar_t>(), Fg, state.data_ptr<scalar_t>(),
                           data_or_null<scalar_t>(normalizer), out.data_ptr<scalar_t>(), data_or_null<scalar_t>(den),
                           final_state.data_ptr<scalar_t>(), data_or_null<scalar_t>(final_normalizer));
  });
}

}  // namespace linattn
