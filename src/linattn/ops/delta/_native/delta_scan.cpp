// The delta rule's chunk form, with or without log decays (the gated delta rule), without
// gradients (delta/native_chunk.py):
//
//   S <- diag(exp(g_t)) S,   u_t = beta_t (v_t - S^T k_t),   S <- S + k_t u_t^T,   out_t = a S^T q_t
//
// with a = scale and log decays g_t <= 0 (-inf resets) per step (Fg = 1), per key channel (Fg = F)
// or none. Per chunk of C positions with the memory S entering it, P_i = sum_{m <= i} g_m and
// E_j = sum_{m > j} g_m inside the chunk and L_ij = sum_{j < m <= i} g_m, the writes U = [u_i] solve
//
//   (I + A) U = diag(beta) (V - (K * exp(P)) S),   A_ij = beta_i sum_f k_if k_jf exp(L_ijf)  (j < i)
//
// by forward substitution (the torch form inverts I + A; chunk.py, gated.py), then
//
//   out_c = a ((Q * exp(P)) S + B U),   B_ij = sum_f q_if k_jf exp(L_ijf)  (j <= i)
//   S <- exp(P_{C-1}) * S + (K * exp(E))^T U
//
// Every exponent is a sum of decays (never a difference), so each factor is at most 1 and a reset
// gives 0, not NaN (chunk_decays.h). A row's chunks depend on each other through S (the writes read
// it), so a row is one task, its chunks in order on one thread: results do not depend on the thread
// count.
#include "delta_scan.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "chunk_decays.h"
#include "fast_exp.h"
#include "native_checks.h"
#include "tile_products.h"

namespace {

using linattn_native::check_tensor;
using linattn_native::exp_of;
using linattn_native::tile_product;
using linattn_native::transpose;

// Rows of a chunk solved one by one inside a block; the rows before a block enter it by one product.
constexpr int64_t kSolveBlock = 16;

struct Sizes {
  int64_t N, G, T, F, E, C, Fg, chunks;  // Fg: 0 without decay, 1 per step, F per channel
  int64_t length(int64_t c) const { return std::min(C, T - c * C); }
};

template <typename scalar_t>
struct Problem {
  Sizes s;
  scalar_t scale;
  const scalar_t *q, *k, *v, *beta, *g;  // g null without decay
};

// One task's buffers, and the chunk computation on them.
template <typename scalar_t>
struct DeltaChunks {
  const Problem<scalar_t>& p;
  std::vector<scalar_t> prefix, suffix, run, decayed, k_t, U, lower, scaled_q, scores, writes_t;

  explicit DeltaChunks(const Problem<scalar_t>& problem) : p(problem) {
    const Sizes& s = p.s;
    const int64_t Fg = std::max<int64_t>(s.Fg, 1);
    prefix.resize(s.C * Fg), suffix.resize(s.C * Fg), run.resize(Fg), decayed.resize(s.C * s.F);
    k_t.resize(s.F * s.C), U.resize(s.C * s.E), lower.resize(s.C * s.C), scaled_q.resize(s.C * s.F);
    scores.resize(s.C * s.C), writes_t.resize(s.F * s.C);
  }

  // rows * exp(table) over L rows of F into `decayed` (the rows themselves without decay).
  const scalar_t* decayed_rows(const scalar_t* rows, int64_t L, const std::vector<scalar_t>& table) {
    if (p.g == nullptr) return rows;
    linattn_native::decay_rows(rows, L, p.s.F, table.data(), p.s.Fg, decayed.data());
    return decayed.data();
  }

  // out[i, j] = sum_f a_if k_jf exp(L_ijf) for j <= i (j < i when `strict`), zero elsewhere
  // (chunk_decays.h); gc the chunk's decays (null: none).
  void scores_of(int64_t L, const scalar_t* a, const scalar_t* k, const scalar_t* gc, bool strict, scalar_t* out) {
    linattn_native::decayed_scores(L, p.s.F, p.s.Fg, a, k, k_t.data(), gc, strict, run.data(), out);
  }

  // U_i += sum_{j < i} lower_ij U_j for i = 0 .. L-1 in order (lower = -A, zero on and above its
  // diagonal): blocks of rows, each taking the rows before it by one product, then row by row.
  void substitute(int64_t L) {
    const int64_t E = p.s.E;
    for (int64_t b0 = 0; b0 < L; b0 += kSolveBlock) {
      const int64_t b1 = std::min(L, b0 + kSolveBlock);
      if (b0 > 0) tile_product(b1 - b0, E, b0, lower.data() + b0 * L, L, U.data(), E, U.data() + b0 * E, E, true);
      for (int64_t i = b0 + 1; i < b1; ++i) {
        scalar_t* ui = U.data() + i * E;
        for (int64_t j = b0; j < i; ++j) {
          const scalar_t a = lower[i * L + j];
          const scalar_t* uj = U.data() + j * E;
          for (int64_t e = 0; e < E; ++e) ui[e] += a * uj[e];
        }
      }
    }
  }

  // Chunk c of row n: its outputs, and the memory S [F, E] carried through it.
  void chunk(int64_t n, int64_t c, scalar_t* S, scalar_t* out) {
    const Sizes& s = p.s;
    const int64_t L = s.length(c), key_row = n * s.T + c * s.C;
    const scalar_t* kc = p.k + key_row * s.F;
    const scalar_t* vc = p.v + key_row * s.E;
    const scalar_t* bc = p.beta + key_row;
    const scalar_t* gc = p.g != nullptr ? p.g + key_row * s.Fg : nullptr;
    if (gc != nullptr) linattn_native::decay_sums(gc, L, s.Fg, run.data(), prefix.data(), suffix.data());
    if (gc == nullptr || s.Fg == 1) transpose(L, s.F, kc, s.F, k_t.data(), L);

    // U = diag(beta) (V - (K * exp(P)) S), then (I + A) U = that by substitution
    tile_product(L, s.E, s.F, decayed_rows(kc, L, prefix), s.F, S, s.E, U.data(), s.E, false);
    for (int64_t i = 0; i < L; ++i)
      for (int64_t e = 0; e < s.E; ++e) U[i * s.E + e] = bc[i] * (vc[i * s.E + e] - U[i * s.E + e]);
    scores_of(L, kc, kc, gc, true, lower.data());
    for (int64_t i = 0; i < L; ++i)
      for (int64_t j = 0; j < i; ++j) lower[i * L + j] *= -bc[i];
    substitute(L);

    for (int64_t h = 0; h < s.G; ++h) {
      const int64_t row = (n * s.G + h) * s.T + c * s.C;
      const scalar_t* qh = p.q + row * s.F;
      for (int64_t i = 0; i < L * s.F; ++i) scaled_q[i] = p.scale * qh[i];
      scalar_t* o = out + row * s.E;
      tile_product(L, s.E, s.F, decayed_rows(scaled_q.data(), L, prefix), s.F, S, s.E, o, s.E, false);
      scores_of(L, scaled_q.data(), kc, gc, false, scores.data());
      tile_product(L, s.E, L, scores.data(), L, U.data(), s.E, o, s.E, true, linattn_native::Triangle::kLower);
    }

    if (gc != nullptr) {  // the memory decays by the chunk's sum; the writes by what follows them
      for (int64_t f = 0; f < s.F; ++f) {
        const scalar_t a = exp_of(linattn_native::decay_at(prefix.data(), s.Fg, L - 1, f));
        for (int64_t e = 0; e < s.E; ++e) S[f * s.E + e] *= a;
      }
      transpose(L, s.F, decayed_rows(kc, L, suffix), s.F, writes_t.data(), L);
    }
    tile_product(s.F, s.E, L, gc != nullptr ? writes_t.data() : k_t.data(), L, U.data(), s.E, S, s.E, true);
  }
};

template <typename scalar_t>
void delta_rows(const Problem<scalar_t>& p, const scalar_t* memory, scalar_t* out, scalar_t* final_memory) {
  const Sizes& s = p.s;
  const int64_t FE = s.F * s.E;
  at::parallel_for(0, s.N, 1, [&](int64_t begin, int64_t end) {
    DeltaChunks<scalar_t> chunks(p);
    for (int64_t n = begin; n < end; ++n) {
      scalar_t* S = final_memory + n * FE;
      std::memcpy(S, memory + n * FE, FE * sizeof(scalar_t));
      for (int64_t c = 0; c < s.chunks; ++c) chunks.chunk(n, c, S, out);
    }
  });
}

}  // namespace

namespace linattn {

void delta_scan_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& beta,
                        const c10::optional<at::Tensor>& g, const at::Tensor& memory, int64_t chunk, double scale,
                        at::Tensor out, at::Tensor final_memory) {
  const char* what = "delta rule scan (native)";
  TORCH_CHECK(q.dim() == 4, what, ": q must be [N, G, T, F], got ", q.sizes());
  TORCH_CHECK(v.dim() == 3, what, ": v must be [N, T, E], got ", v.sizes());
  TORCH_CHECK(chunk >= 1, what, ": chunk ", chunk, " < 1");
  Sizes s;
  s.N = q.size(0), s.G = q.size(1), s.T = q.size(2), s.F = q.size(3), s.E = v.size(2), s.C = chunk;
  s.chunks = (s.T + chunk - 1) / chunk;
  s.Fg = 0;
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, what, ": computes in float32 or float64, got ", dtype);
  check_tensor(what, q, "q", dtype, {s.N, s.G, s.T, s.F});
  check_tensor(what, k, "k", dtype, {s.N, s.T, s.F});
  check_tensor(what, v, "v", dtype, {s.N, s.T, s.E});
  check_tensor(what, beta, "beta", dtype, {s.N, s.T});
  if (g.has_value()) {
    TORCH_CHECK(g->dim() == 3 && (g->size(2) == 1 || g->size(2) == s.F), what, ": g must be [N, T, 1] or [N, T, ",
                s.F, "], got ", g->sizes());
    s.Fg = g->size(2);
    check_tensor(what, *g, "g", dtype, {s.N, s.T, s.Fg});
  }
  check_tensor(what, memory, "memory", dtype, {s.N, s.F, s.E});
  check_tensor(what, out, "out", dtype, {s.N, s.G, s.T, s.E});
  check_tensor(what, final_memory, "final_memory", dtype, {s.N, s.F, s.E});
  AT_DISPATCH_FLOATING_TYPES(dtype, "delta_scan_forward", [&] {
    const Problem<scalar_t> p{s, static_cast<scalar_t>(scale), q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                              v.data_ptr<scalar_t>(), beta.data_ptr<scalar_t>(),
                              g.has_value() ? g->data_ptr<scalar_t>() : nullptr};
    delta_rows<scalar_t>(p, memory.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), final_memory.data_ptr<scalar_t>());
  });
}

}  // namespace linattn
