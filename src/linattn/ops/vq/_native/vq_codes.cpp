// Keys and their codes on CPUs: the nearest code of every key, for float32 keys
// (nn/quantizer.py's nearest_codes), and whether given keys are the codebook's rows at given
// codes (vq_attention's check of k_hat, ops/vq/checks.py).
//
//   z_t = argmin_s (|c_s|^2 - 2 k_t . c_s)        (the first minimum; a NaN distance wins)
//
// per (batch, head) row: the products k . c of a chunk of keys by one matrix product against
// the head's codebook, then one pass per key over its S distances. Optionally the chosen codes'
// rows (chosen [B, H, T, D]) and the squared errors |k - c_z|^2 summed per chunk of keys
// (errors [B H chunks], float64; the chunks in order). Rows and chunks are spread
// over the intra-op threads; a key's code is computed by one thread from one product, so
// results do not depend on the thread count. The distances are formed as the torch form forms
// them (-2 (k . c) + |c|^2, in float32).
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "vq_kernels.h"

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

void vq_nearest_codes(const at::Tensor& keys, const at::Tensor& codebook, const at::Tensor& norms, at::Tensor codes,
                      const c10::optional<at::Tensor>& chosen, const c10::optional<at::Tensor>& errors) {
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
  if (chosen.has_value())
    TORCH_CHECK(chosen->sizes() == keys.sizes() && chosen->is_contiguous() && chosen->scalar_type() == at::kFloat,
                "vq_nearest_codes (native): chosen must be a contiguous float32 tensor shaped like keys");
  if (errors.has_value())
    TORCH_CHECK(errors->numel() == B * H * chunks && errors->is_contiguous() && errors->scalar_type() == at::kDouble,
                "vq_nearest_codes (native): errors must be a contiguous float64 tensor of ", B * H * chunks, " sums");
  const float* norm_data = norms.data_ptr<float>();
  const float* key_data = keys.data_ptr<float>();
  const float* book_data = codebook.data_ptr<float>();
  float* chosen_data = chosen.has_value() ? chosen->data_ptr<float>() : nullptr;
  double* error_data = errors.has_value() ? errors->data_ptr<double>() : nullptr;
  int64_t* code_data = codes.data_ptr<int64_t>();
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t begin, int64_t end) {
    at::Tensor dots = at::empty({kChunk, S}, keys.options());
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / chunks, h = bh % H, start = (task % chunks) * kChunk;
      const int64_t n = std::min(kChunk, T - start);
      at::Tensor piece = dots.narrow(0, 0, n);
      at::mm_out(piece, keys[bh / H][h].narrow(0, start, n), codebook[h].t());
      const float* dot_data = piece.data_ptr<float>();
      double error = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int64_t t = bh * T + start + i, z = nearest(dot_data + i * S, norm_data + h * S, S);
        code_data[t] = z;
        const float* code = book_data + (h * S + z) * D;
        if (chosen_data != nullptr) std::memcpy(chosen_data + t * D, code, D * sizeof(float));
        if (error_data != nullptr) {  // |k - c_z|^2 of the key, in float32, summed per chunk in float64
          const float* key = key_data + t * D;
          float squared = 0;
#pragma omp simd reduction(+ : squared)
          for (int64_t d = 0; d < D; ++d) squared += (key[d] - code[d]) * (key[d] - code[d]);
          error += squared;
        }
      }
      if (error_data != nullptr) error_data[task] = error;
    }
  });
}

// Whether k_hat[b, h, t] == codebook[h, codes[b, h, t]] for every position (as torch.equal
// compares: by value, a NaN equal to nothing), codes in [0, S) (checked before this is called).
bool vq_keys_are_codes(const at::Tensor& k_hat, const at::Tensor& codes, const at::Tensor& codebook) {
  TORCH_CHECK(k_hat.dim() == 4 && codes.dim() == 3 && codebook.dim() == 3 && k_hat.is_contiguous() &&
                  codes.is_contiguous() && codebook.is_contiguous() && codes.scalar_type() == at::kLong &&
                  k_hat.scalar_type() == codebook.scalar_type() && k_hat.device().is_cpu(),
              "vq_keys_are_codes (native): contiguous CPU k_hat [B, H, T, D], int64 codes [B, H, T], codebook [H, S, D]");
  const int64_t B = k_hat.size(0), H = k_hat.size(1), T = k_hat.size(2), D = k_hat.size(3), S = codebook.size(1);
  TORCH_CHECK(codes.sizes() == at::IntArrayRef({B, H, T}) && codebook.size(0) == H && codebook.size(2) == D,
              "vq_keys_are_codes (native): codes ", codes.sizes(), " and codebook ", codebook.sizes(), " for k_hat ",
              k_hat.sizes());
  std::atomic<bool> equal{true};
  AT_DISPATCH_FLOATING_TYPES(k_hat.scalar_type(), "vq_keys_are_codes", [&] {
    const scalar_t* key_data = k_hat.data_ptr<scalar_t>();
    const scalar_t* book = codebook.data_ptr<scalar_t>();
    const int64_t* code_data = codes.data_ptr<int64_t>();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
      for (int64_t bh = begin; bh < end && equal.load(std::memory_order_relaxed); ++bh) {
        const scalar_t* rows = book + (bh % H) * S * D;
        for (int64_t t = 0; t < T; ++t) {
          const int64_t z = code_data[bh * T + t];
          TORCH_CHECK(z >= 0 && z < S, "vq_keys_are_codes (native): code ", z, " outside [0, ", S, ")");
          const scalar_t* key = key_data + (bh * T + t) * D;
          const scalar_t* row = rows + z * D;
          bool same = true;
          for (int64_t d = 0; d < D; ++d) same &= key[d] == row[d];
          if (!same) {
            equal.store(false, std::memory_order_relaxed);
            return;
          }
        }
      }
    });
  });
  return equal.load();
}

}  // namespace linattn
