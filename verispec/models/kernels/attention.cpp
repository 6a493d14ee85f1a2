// Attention for the few new tokens of a decoding or verify pass, one query at a time (AVX-512).
//
// Every (row b, new token t, head h) is computed alone, over the keys 0 .. counts[b, t] - 1 of its
// row, in slot order, with the same float operations in the same order whatever else is in the
// call: a token verified at position p gets the very bits plain decoding gives it at p (verispec's
// batch invariance), in one call for the whole pass instead of one torch call per token.
//
//   s_j = (q . k_j) * D^-1/2, float32 sums over D in a fixed order
//   out = sum_j exp(s_j - max s) v_j / sum_j exp(s_j - max s)
//
// q: (B, H, T, D); keys, values: (B, Hkv, S, D), bfloat16 or float32 (the KV cache's dtype), query
// heads grouped over key/value heads as Qwen2 and Llama do (h uses h / (H / Hkv)); D a multiple of 16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "bfloat16.h"

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return from_bfloat16(p); }

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bfloat16(v)); }

// exp(x) for x <= 0 (scores minus their max): Cephes' single-precision polynomial, 2^n by scalef.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // below this exp underflows to ~0 anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// One query over n keys and values (rows of `stride` elements, D = 16 * chunks used): out (D,).
template <typename kv_t>
void attend_one(const kv_t* q, const kv_t* keys, const kv_t* values, int64_t n, int64_t stride, int chunks,
                float scale, float* scores, kv_t* out) {
  __m512 query[16];
  for (int c = 0; c < chunks; ++c) query[c] = load16(q + 16 * c);
  float max_score = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const kv_t* key = keys + j * stride;
    __m512 acc = _mm512_mul_ps(query[0], load16(key));
    for (int c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(query[c], load16(key + 16 * c), acc);
    scores[j] = _mm512_reduce_add_ps(acc) * scale;
    max_score = std::max(max_score, scores[j]);
  }
  // exp(s - max) 16 scores at a time (the tail masked), summed in a fixed order.
  __m512 total = _mm512_setzero_ps();
  const __m512 shift = _mm512_set1_ps(max_score);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 lanes = n - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, scores + j), shift));
    _mm512_mask_storeu_ps(scores + j, lanes, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(lanes, e));
  }
  const __m512 denominator = _mm512_set1_ps(_mm512_reduce_add_ps(total));
  __m512 acc[16];
  for (int c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 weight = _mm512_set1_ps(scores[j]);
    const kv_t* value = values + j * stride;
    for (int c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(weight, load16(value + 16 * c), acc[c]);
  }
  for (int c = 0; c < chunks; ++c) store16(out + 16 * c, _mm512_div_ps(acc[c], denominator));
}

// q (B, H, T, D), keys and values (B, Hkv, S, D) (any strides with D contiguous), counts (B, T) int64:
// token t of row b sees slots 0 .. counts[b, t] - 1. Returns (B, H, T, D) in q's dtype.
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const at::Tensor& counts) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4, "attend: q, keys, values must be 4-d");
  TORCH_CHECK(q.scalar_type() == keys.scalar_type() && keys.scalar_type() == values.scalar_type(),
              "attend: q, keys and values must share a dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "attend: float32 or bfloat16");
  const int64_t batch = q.size(0), heads = q.size(1), tokens = q.size(2), dim = q.size(3);
  const int64_t kv_heads = keys.size(1), slots = keys.size(2);
  TORCH_CHECK(dim % 16 == 0 && dim <= 256, "attend: head size must be a multiple of 16, at most 256");
  TORCH_CHECK(heads % kv_heads == 0 && keys.sizes() == values.sizes() && keys.size(0) == batch && keys.size(3) == dim,
              "attend: shapes do not match");
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == batch && counts.size(1) == tokens && counts.scalar_type() == at::kLong,
              "attend: counts must be (B, T) int64");
  // One contiguous layout for each (b, kv head): slots of D elements; the cache's views are narrowed along S.
  const at::Tensor qc = q.contiguous(), cc = counts.contiguous();
  const at::Tensor kc = keys.stride(3) == 1 && keys.stride(2) == dim ? keys : keys.contiguous();
  const at::Tensor vc = values.stride(3) == 1 && values.stride(2) == dim ? values : values.contiguous();
  const int64_t* count = cc.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * tokens; ++i) {
    TORCH_CHECK(count[i] >= 1 && count[i] <= slots, "attend: a token sees ", count[i], " of ", slots, " slots");
  }
  at::Tensor out = at::empty_like(qc);
  const int chunks = static_cast<int>(dim / 16);
  const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
  const int64_t group = heads / kv_heads;
  const auto run = [&](auto* typed) {
    using scalar_t = std::remove_pointer_t<decltype(typed)>;
    const scalar_t* q_ptr = qc.data_ptr<scalar_t>();
    const scalar_t* k_ptr = kc.data_ptr<scalar_t>();
    const scalar_t* v_ptr = vc.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, batch * heads * tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(slots + 16);
      for (int64_t item = begin; item < end; ++item) {  // item = (b, h, t), row-major as q is
        const int64_t b = item / (heads * tokens), h = item / tokens % heads, t = item % tokens;
        const int64_t k_offset = b * kc.stride(0) + (h / group) * kc.stride(1);
        const int64_t v_offset = b * vc.stride(0) + (h / group) * vc.stride(1);
        attend_one(q_ptr + item * dim, k_ptr + k_offset, v_ptr + v_offset, count[b * tokens + t], dim, chunks, scale,
                   scores.data(), out_ptr + item * dim);
      }
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<at::BFloat16*>(nullptr));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("attend(Tensor q, Tensor keys, Tensor values, Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("attend", &attend);
}
