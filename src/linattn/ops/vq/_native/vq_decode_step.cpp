// One Transformer-VQ decoding step over the resident buffer (ops/_vq_resident.py), fused.
//
// The same computation as _vq_resident.quantize_and_decode, for CPU tensors in float32 or
// float64, one (batch, kv head) row per task of at::parallel_for (a row is computed by one
// thread from start to end, so results do not depend on the thread count). Per row:
//
//   z          = argmin_s |c_s|^2 - 2 k.c_s            (float32, the first minimum; a NaN wins),
//                or given_codes [B, Hkv] where given (a quantizer that is not a nearest-code search);
//                with `soft_keys` (soft VQ) no code: k itself enters the buffer, codes untouched
//   buffer     : codes[L + p] = z, mask[L + p] = 0, keys[L + p] = c_z, values[L + p] = v
//   score_j    = mask_j + scale * q.key_j (+ r_{j - p} for columns p .. p + L)
//   out        = sum_j softmax(score)_j values_j
//
// where the query is scored against the codebook once: the cache's columns 2L + s (whose keys
// are the codebook's rows) take q.c_s, and so do the window's columns, q.key_j = q.c_s at
// s = codes_j, when every key of the buffer is a code; else those read their keys. With ReRoPE
// (`rerope` w > 0, the keys unrotated, rerope.py) a column at distance d = L + p - j from the
// query is scored by R(min(d, w)) q: every column by R(w) q as above, then the window's
// columns with d < w by their own turn of q. Columns whose weight is exactly 0 (empty rows,
// mask -inf) are skipped in the output sum.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "fast_exp.h"
#include "lane_dot.h"
#include "native_checks.h"
#include "rotation.h"
#include "vq_kernels.h"

namespace {

template <typename T>
void decode_rows(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& search_t,
                 const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor& keys, at::Tensor& values,
                 at::Tensor& codes, at::Tensor& mask, int64_t L, int64_t p, double scale,
                 const c10::optional<at::Tensor>& relative, bool keys_are_codes, int64_t rerope,
                 const c10::optional<at::Tensor>& rerope_frequencies, const c10::optional<at::Tensor>& given_codes,
                 bool soft_keys, at::Tensor& out, at::Tensor& new_codes) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(q.dim() == 4 && v.dim() == 3 && search_t.dim() == 3 && keys.dim() == 4,
              "vq_decode_step (native): q [B, Hkv, G, Dk], v [B, Hkv, Dv], search_t [Hkv, Dk, S], keys [B, Hkv, C, Dk]");
  const int64_t B = q.size(0), Hkv = q.size(1), G = q.size(2), Dk = q.size(3);
  const int64_t Dv = v.size(2), S = search_t.size(2), C = keys.size(2);
  TORCH_CHECK(C == 2 * L + S && p >= 0 && p < L, "vq_decode_step (native): a buffer of ", C,
              " columns does not fit L = ", L, ", S = ", S, ", p = ", p);
  const auto check = [](const at::Tensor& t, const char* name, at::ScalarType type, at::IntArrayRef shape) {
    linattn_native::check_tensor("vq_decode_step (native)", t, name, type, shape);
  };
  check(q, "q", dtype, {B, Hkv, G, Dk});
  check(k, "k", dtype, {B, Hkv, Dk});
  check(v, "v", dtype, {B, Hkv, Dv});
  check(search_t, "search_t", at::kFloat, {Hkv, Dk, S});
  check(norms, "norms", at::kFloat, {Hkv, S});
  check(codebook_t, "codebook_t", dtype, {Hkv, Dk, S});
  check(keys, "keys", dtype, {B, Hkv, C, Dk});
  check(values, "values", dtype, {B, Hkv, C, Dv});
  if (!soft_keys) check(codes, "codes", at::kLong, {B, Hkv, C});
  check(mask, "mask", dtype, {B, Hkv, C});
  check(out, "out", dtype, {B, Hkv, G, Dv});
  if (!soft_keys) check(new_codes, "new_codes", at::kLong, {B, Hkv});
  TORCH_CHECK(!soft_keys || (!keys_are_codes && !given_codes.has_value()), "vq_decode_step (native): soft keys are "
              "no codes (keys_are_codes false, no given_codes)");
  const int64_t* given = nullptr;
  if (given_codes.has_value()) {
    check(*given_codes, "given_codes", at::kLong, {B, Hkv});
    given = given_codes->data_ptr<int64_t>();
    for (int64_t i = 0; i < B * Hkv; ++i) {
      TORCH_CHECK(given[i] >= 0 && given[i] < S, "vq_decode_step (native): given code ", given[i], " is not in [0, ",
                  S, ")");
    }
  }
  const int64_t w = rerope;
  TORCH_CHECK(w >= 0 && w <= L, "vq_decode_step (native): rerope ", w, " is not in [0, L = ", L, "]");
  std::vector<T> turns;  // the turns R(d) for d = 0 .. w: [w + 1, Dk / 2, 2]
  if (w > 0) {
    TORCH_CHECK(Dk % 2 == 0 && rerope_frequencies.has_value(),
                "vq_decode_step (native): ReRoPE needs an even Dk and rerope_frequencies [Dk / 2]");
    check(*rerope_frequencies, "rerope_frequencies", dtype, {Dk / 2});
    turns = linattn_native::turn_table(rerope_frequencies->data_ptr<T>(), Dk, w + 1);
  }
  const int64_t row = L + p;
  const T* q_data = q.data_ptr<T>();
  const T* k_data = k.data_ptr<T>();
  const T* v_data = v.data_ptr<T>();
  const float* search_data = search_t.data_ptr<float>();
  const float* norm_data = norms.data_ptr<float>();
  const T* book_data = codebook_t.data_ptr<T>();
  T* key_data = keys.data_ptr<T>();
  T* value_data = values.data_ptr<T>();
  int64_t* code_data = soft_keys ? nullptr : codes.data_ptr<int64_t>();
  T* mask_data = mask.data_ptr<T>();
  T* out_data = out.data_ptr<T>();
  int64_t* new_code_data = soft_keys ? nullptr : new_codes.data_ptr<int64_t>();
  const T* relative_data = nullptr;
  int64_t rb = 0, rh = 0, rg = 0, rj = 0;  // strides of relative [B, Hkv, G, L + 1] (0: broadcast)
  if (relative.has_value()) {
    const at::Tensor& r = *relative;
    TORCH_CHECK(r.scalar_type() == dtype && r.dim() == 4 && r.size(0) == B && r.size(1) == Hkv && r.size(2) == G &&
                    r.size(3) == L + 1,
                "vq_decode_step (native): relative must be [B, Hkv, G, L + 1] in the inputs' dtype");
    relative_data = r.data_ptr<T>();
    rb = r.stride(0), rh = r.stride(1), rg = r.stride(2), rj = r.stride(3);
  }
  const T scale_t = static_cast<T>(scale);
  const T minus_inf = -std::numeric_limits<T>::infinity();

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> key_scores(S);
    std::vector<T> code_scores(G * S), scores(C), turned(Dk), far(G * Dk);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / Hkv, h = bh % Hkv, base = bh * C;
      int64_t z = 0;
      if (soft_keys) {
        // no code: the key enters as it is
      } else if (given != nullptr) {
        z = given[bh];
      } else {  // the nearest code, one codebook column (one key channel) at a time
        const float* book32 = search_data + h * Dk * S;
        float* ks = key_scores.data();
        for (int64_t s = 0; s < S; ++s) ks[s] = 0.0f;
        for (int64_t d = 0; d < Dk; ++d) {
          const float x = static_cast<float>(k_data[bh * Dk + d]);
          const float* column = book32 + d * S;
          for (int64_t s = 0; s < S; ++s) ks[s] += x * column[s];
        }
        const float* norm = norm_data + h * S;
        float best = std::numeric_limits<float>::infinity();
        for (int64_t s = 0; s < S; ++s) {
          const float distance = norm[s] + -2.0f * ks[s];
          if (std::isnan(distance)) {
            z = s;
            break;
          }
          if (distance < best) best = distance, z = s;
        }
      }
      // the new position enters the buffer
      const T* book = book_data + h * Dk * S;
      if (soft_keys) {
        std::copy_n(k_data + bh * Dk, Dk, key_data + (base + row) * Dk);
      } else {
        new_code_data[bh] = z;
        code_data[base + row] = z;
        for (int64_t d = 0; d < Dk; ++d) key_data[(base + row) * Dk + d] = book[d * S + z];
      }
      mask_data[base + row] = 0;
      for (int64_t d = 0; d < Dv; ++d) value_data[(base + row) * Dv + d] = v_data[bh * Dv + d];
      const T* queries = q_data + bh * G * Dk;  // R(w) q with ReRoPE: how the far columns see them
      if (w > 0) {
        std::copy_n(queries, G * Dk, far.data());
        linattn_native::turn(far.data(), G, Dk, turns.data() + w * Dk);
        queries = far.data();
      }
      T* qs = code_scores.data();  // every query of the group against the codebook (rows 2L.. of the keys)
      for (int64_t i = 0; i < G * S; ++i) qs[i] = 0;
      for (int64_t d = 0; d < Dk; ++d) {
        const T* column = book + d * S;
        for (int64_t g = 0; g < G; ++g) {
          const T x = queries[g * Dk + d];
          T* qs_g = qs + g * S;
          for (int64_t s = 0; s < S; ++s) qs_g[s] += x * column[s];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        T* sc = scores.data();
        const T* m = mask_data + base;
        const T* qs_g = code_scores.data() + g * S;
        if (keys_are_codes) {
          const int64_t* column_codes = code_data + base;
          for (int64_t j = 0; j < 2 * L; ++j) sc[j] = m[j] + scale_t * qs_g[column_codes[j]];
        } else {
          const T* query = queries + g * Dk;
          for (int64_t j = 0; j < 2 * L; ++j) {
            sc[j] = m[j] + scale_t * linattn_native::dot(query, key_data + (base + j) * Dk, Dk);
          }
        }
        for (int64_t s = 0; s < S; ++s) sc[2 * L + s] = m[2 * L + s] + scale_t * qs_g[s];
        if (w > 0) {  // the window's columns nearer than w: R(d) q
          const T* query = q_data + (bh * G + g) * Dk;
          for (int64_t d = 0; d < w && d <= row; ++d) {
            T* turn = turned.data();
            std::copy_n(query, Dk, turn);
            linattn_native::turn(turn, 1, Dk, turns.data() + d * Dk);
            sc[row - d] = m[row - d] + scale_t * linattn_native::dot(turn, key_data + (base + row - d) * Dk, Dk);
          }
        }
        if (relative_data != nullptr) {
          const T* r = relative_data + b * rb + h * rh + g * rg;
          for (int64_t j = 0; j <= L; ++j) sc[p + j] += r[j * rj];
        }
        T top = minus_inf;
        for (int64_t j = 0; j < C; ++j) top = sc[j] > top ? sc[j] : top;
#pragma omp simd
        for (int64_t j = 0; j < C; ++j) sc[j] = linattn_native::exp_of(sc[j] - top);
        T* o = out_data + (bh * G + g) * Dv;
        for (int64_t d = 0; d < Dv; ++d) o[d] = 0;
        T total = 0;
        for (int64_t j = 0; j < C; ++j) {
          const T w = sc[j];
          if (w == 0) continue;
          total += w;
          const T* value = value_data + (base + j) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] += w * value[d];
        }
        const T inverse = T(1) / total;
        for (int64_t d = 0; d < Dv; ++d) o[d] *= inverse;
      }
    }
  });
}

}  // namespace

namespace linattn {

void vq_decode_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& search_t,
                    const at::Tensor& norms, const at::Tensor& codebook_t, at::Tensor keys, at::Tensor values,
                    at::Tensor codes, at::Tensor mask, int64_t L, int64_t p, double scale,
                    const c10::optional<at::Tensor>& relative, bool keys_are_codes, int64_t rerope,
                    const c10::optional<at::Tensor>& rerope_frequencies, const c10::optional<at::Tensor>& given_codes,
                    bool soft_keys, at::Tensor out, at::Tensor new_codes) {
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "vq_decode_step", [&] {
    decode_rows<scalar_t>(q, k, v, search_t, norms, codebook_t, keys, values, codes, mask, L, p, scale, relative,
                          keys_are_codes, rerope, rerope_frequencies, given_codes, soft_keys, out, new_codes);
  });
}

}  // namespace linattn
