// The two ends of a language model's token step, shared by the whole-model steps
// (vq_model_step.cpp, block_model_step.cpp): the embedding rows of the token ids, and the
// final RMSNorm, the head and the greedy choice.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "row_products.h"

namespace linattn_native {

// The ids [B] (int64) checked against the vocabulary [0, vocab), or an error naming the first
// that is not; `what` names the kernel. Returns them contiguous.
inline at::Tensor checked_ids(const char* what, const at::Tensor& ids, int64_t vocab) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(), what,
              ": ids must be a [B] int64 CPU tensor");
  at::Tensor rows = ids.contiguous();
  const int64_t* id = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < rows.size(0); ++b) {
    TORCH_CHECK(id[b] >= 0 && id[b] < vocab, what, ": token id ", id[b], " is not in [0, ", vocab, ")");
  }
  return rows;
}

// logits: a contiguous [B, V] tensor of `dtype`; greedy, when given, a contiguous [B] int64 tensor.
inline void check_outputs(const char* what, const at::Tensor& logits, int64_t B, int64_t V, at::ScalarType dtype,
                          const c10::optional<at::Tensor>& greedy) {
  TORCH_CHECK(logits.sizes() == at::IntArrayRef({B, V}) && logits.is_contiguous() && logits.scalar_type() == dtype,
              what, ": logits must be a contiguous [B, V] tensor of the model's dtype");
  TORCH_CHECK(!greedy.has_value() || (greedy->sizes() == at::IntArrayRef({B}) && greedy->scalar_type() == at::kLong &&
                                      greedy->is_contiguous()),
              what, ": greedy must be a contiguous [B] int64 tensor");
}

// rows[b] = table[id[b]] for b < B, rows of d.
template <typename T>
void embed_rows(const T* table, const int64_t* id, int64_t B, int64_t d, T* rows) {
  for (int64_t b = 0; b < B; ++b) std::copy_n(table + id[b] * d, d, rows + b * d);
}

// 1 / sqrt(mean(x^2) + eps) over the n values of x (an RMSNorm's scale).
template <typename T>
T inverse_rms(const T* x, int64_t n, double eps) {
  T sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];
  return T(1) / std::sqrt(sum / static_cast<T>(n) + static_cast<T>(eps));
}

// logits [B, V] = (rows / sqrt(mean(rows^2) + eps) * gain) head_t, in place on rows [B, d];
// greedy [B], when not null, each row's argmax (the first largest logit, as torch.argmax), or
// -1 where a logit of the row is not finite.
template <typename T>
void final_logits(T* rows, int64_t B, int64_t d, const T* gain, double eps, const T* head_t, int64_t V, T* logits,
                  int64_t* greedy) {
  for (int64_t b = 0; b < B; ++b) {
    T* row = rows + b * d;
    const T r = inverse_rms(row, d, eps);
    for (int64_t i = 0; i < d; ++i) row[i] = row[i] * r * gain[i];
  }
  linattn::rows_times(static_cast<const T*>(rows), B, d, head_t, V, static_cast<const T*>(nullptr), logits);
  if (greedy == nullptr) return;
  for (int64_t b = 0; b < B; ++b) {
    const T* row = logits + b * V;
    int64_t best = 0;
    for (int64_t j = 0; j < V && best >= 0; ++j) {
      if (!std::isfinite(row[j])) best = -1;
      else if (row[j] > row[best]) best = j;
    }
    greedy[b] = best;
  }
}

}  // namespace linattn_native
