// The nearest code of every key, for CPU float32 keys (nn/quantizer.py's nearest_codes).
//
//   z_t = argmin_s (|c_s|^2 - 2 k_t . c_s)        (the first minimum; a NaN distance wins)
//
// per (batch, head) row: the products k . c of a chunk of keys by one matrix product against
// the head's codebook, then one pass per key over its S distances. Rows and chunks are spread
// over the intra-op threads; a key's code is computed by one thread from one product, so
// results do not depend on the thread count. The distances are formed as the torch form forms
// them (-2 (k . c) + |c|^2, in float32).
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>

namespace {

constexpr int64_t kChunk = 256;  // keys per product

// The first s of least distance, or the first NaN distance when there is one (torch's argmin):
// the least value and whether a NaN occurs in one vectorised pass, then the first s that matches.
int64_t nearest(const float* dots, const float* norms, int64_t S) {
  float best = std::numeric_limits<float>::infinity();
  int nan_seen = 0;
#pragma omp simd reduction(min : best) reduction(| : nan_seen)
  for (int64_t s = 0; s < S; ++s) {
    const float distance = -2.0f * dots[s] + norms[s];
    best = distance < best ? distance : best;
    nan_seen |= distance != distance;
  }
  for (int64_t s = 0; s < S; ++s) {
    const float distance = -2.0f * dots[s] + norms[s];
    if (nan_seen ? distance != distance : distance == best) return s;
  }
  return 0;  // every distance is +inf: the first
}

}  // namespace

namespace linattn {

void vq_nearest_codes(const at::Tensor& keys, const at::Tensor& codebook, const at::Tensor& norms, at::Tensor codes) {
  TORCH_CHECK(keys.dim() == 4 && codebook.dim() == 3 && norms.dim() == 2 && codes.dim() == 3,
              "vq_nearest_codes (native): keys [B, H, T, D], codebook [H, S, D], norms [H, S], codes [B, H, T]");
  const int64_t B = keys.size(0), H = keys.size(1), T = keys.size(2), D = keys.size(3), S = codebook.size(1);
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{keys, "keys"}, {codebook, "codebook"},
                                {norms, "norms"}}) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat, "vq_nearest_codes (native): ",
                name, " must be a contiguous CPU float32 tensor, got ", t.scalar_type(), " on ", t.device(),
                t.is_contiguous() ? "" : " (not contiguous)");
  }
  TORCH_CHECK(codebook.size(0) == H && codebook.size(2) == D && norms.size(0) == H && norms.size(1) == S,
              "vq_nearest_codes (native): codebook ", codebook.sizes(), " and norms ", norms.sizes(), " for keys ",
              keys.sizes());
  TORCH_CHECK(codes.sizes() == at::IntArrayRef({B, H, T}) && codes.is_contiguous() && codes.scalar_type() == at::kLong,
              "vq_nearest_codes (native): codes must be a contiguous int64 tensor [B, H, T]");
  const int64_t chunks = (T + kChunk - 1) / kChunk;
  const float* norm_data = norms.data_ptr<float>();
  int64_t* code_data = codes.data_ptr<int64_t>();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor dots = at::empty({kChunk, S}, keys.options());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, h = bh % H, start = (task % chunks) * kChunk;
      const int64_t n = std::min(kChunk, T - start);
      at::Tensor piece = dots.narrow(0, 0, n);
      at::mm_out(piece, keys[bh / H][h].narrow(0, start, n), codebook[h].t());
      const float* dot_data = piece.data_ptr<float>();
      for (int64_t i = 0; i < n; ++i)
        code_data[bh * T + start + i] = nearest(dot_data + i * S, norm_data + h * S, S);
    }
  });
}

}  // namespace linattn
