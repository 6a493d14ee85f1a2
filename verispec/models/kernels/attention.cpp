// Attention for the few new tokens of a decoding or verify pass, one query at a time (AVX-512, or AVX2
// where the CPU has no AVX-512).
//
// Every (row b, new token t, head h) is computed alone, over the keys 0 .. counts[b, t] - 1 of its
// row, in slot order, with the same float operations in the same order whatever else is in the
// call: a token verified at position p gets the very bits plain decoding gives it at p (verispec's
// batch invariance), in one call for the whole pass instead of one torch call per token. The query
// heads that share a key/value head read its keys and values together (see attend_group).
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

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 (scores minus their max): Cephes' single-precision polynomial, 2^n by scalef.
inline vec16 exp_nonpositive(vec16 x) {
  x = v_max(x, v_set1(-87.0f));  // below this exp underflows to ~0 anyway
  const vec16 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
  vec16 r = v_fnmadd(n, v_set1(0.693359375f), x);
  r = v_fnmadd(n, v_set1(-2.12194440e-4f), r);
  vec16 p = v_set1(1.9875691500e-4f);
  p = v_fmadd(p, r, v_set1(1.3981999507e-3f));
  p = v_fmadd(p, r, v_set1(8.3334519073e-3f));
  p = v_fmadd(p, r, v_set1(4.1665795894e-2f));
  p = v_fmadd(p, r, v_set1(1.6666665459e-1f));
  p = v_fmadd(p, r, v_set1(5.0000001201e-1f));
  p = v_fmadd(p, v_mul(r, r), v_add(r, v_set1(1.0f)));
  return v_scale_by_power_of_two(p, n);
}

constexpr int kMaxGroup = 16;  // query heads per key/value head (Qwen2.5: 6 or 7; Llama 3: 4)

// The `group` query heads that share one key/value head, each over the same n keys (rows of `stride`
// elements, D = 16 * chunks): out[h] (D,) for each. Each key and value row is read (and widened from
// bfloat16) once for all the heads instead of once per head, and each head's arithmetic is what it
// would be alone, in the same order:
//   s_j = sum_c q_c * k_jc (one float32 vector per chunk, added lane-wise, then reduced) * scale,
//   out = sum_j exp(s_j - max) v_j / sum_j exp(s_j - max).
// queries: (group, D) float32; scores: (group, stride_scores) float32 scratch.
template <typename kv_t, typename out_t>
void attend_group(const float* queries, int group, const kv_t* keys, const kv_t* values, int64_t n, int64_t stride,
                  int chunks, float scale, float* scores, int64_t stride_scores, out_t* const* out) {
  const int64_t dim = 16 * chunks;
  float max_score[kMaxGroup];
  for (int h = 0; h < group; ++h) max_score[h] = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    vec16 key[16];
    for (int c = 0; c < chunks; ++c) key[c] = load16(keys + j * stride + 16 * c);
    for (int h = 0; h < group; ++h) {
      const float* query = queries + h * dim;
      vec16 acc = v_mul(v_load(query), key[0]);
      for (int c = 1; c < chunks; ++c) acc = v_fmadd(v_load(query + 16 * c), key[c], acc);
      const float score = v_sum(acc) * scale;
      scores[h * stride_scores + j] = score;
      max_score[h] = std::max(max_score[h], score);
    }
  }
  // exp(s - max) 16 scores at a time (the tail masked), summed in a fixed order.
  vec16 denominator[kMaxGroup];
  for (int h = 0; h < group; ++h) {
    float* row = scores + h * stride_scores;
    vec16 total = v_zero();
    const vec16 shift = v_set1(max_score[h]);
    for (int64_t j = 0; j < n; j += 16) {
      const vec16 e = exp_nonpositive(v_sub(v_load_first(row + j, n - j), shift));
      v_store_first(row + j, n - j, e);
      total = v_add(total, v_keep_first(e, n - j));
    }
    denominator[h] = v_set1(v_sum(total));
  }
  // Two chunks of every head's output at a time: 2 * group accumulators stay in registers.
  for (int c0 = 0; c0 < chunks; c0 += 2) {
    const int width = std::min(2, chunks - c0);
    vec16 acc[kMaxGroup][2];
    for (int h = 0; h < group; ++h) acc[h][0] = acc[h][1] = v_zero();
    for (int64_t j = 0; j < n; ++j) {
      const kv_t* value = values + j * stride + 16 * c0;
      const vec16 v0 = load16(value), v1 = width == 2 ? load16(value + 16) : v_zero();
      for (int h = 0; h < group; ++h) {
        const vec16 weight = v_set1(scores[h * stride_scores + j]);
        acc[h][0] = v_fmadd(weight, v0, acc[h][0]);
        acc[h][1] = v_fmadd(weight, v1, acc[h][1]);
      }
    }
    for (int h = 0; h < group; ++h) {
      for (int c = 0; c < width; ++c) store16(out[h] + 16 * (c0 + c), v_div(acc[h][c], denominator[h]));
    }
  }
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
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup && keys.sizes() == values.sizes() && keys.size(0) == batch && keys.size(3) == dim,
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
  // One work item per (row b, key/value head, new token t): the query heads sharing those keys go together
  // (B * Hkv * T items: two already for one token of a Qwen2.5 model, one per thread here).
  const auto run = [&](auto* typed) {
    using scalar_t = std::remove_pointer_t<decltype(typed)>;
    const scalar_t* q_ptr = qc.data_ptr<scalar_t>();
    const scalar_t* k_ptr = kc.data_ptr<scalar_t>();
    const scalar_t* v_ptr = vc.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    const int64_t stride_scores = slots + 16;
    at::parallel_for(0, batch * kv_heads * tokens, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores(group * stride_scores), queries(group * dim);
      scalar_t* outs[kMaxGroup];
      for (int64_t item = begin; item < end; ++item) {  // item = (b, kv head, t)
        const int64_t b = item / (kv_heads * tokens), kv = item / tokens % kv_heads, t = item % tokens;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t query = (b * heads + kv * group + g) * tokens + t;  // q is (B, H, T, D), row-major
          for (int64_t i = 0; i < dim; i += 16) v_store(queries.data() + g * dim + i, load16(q_ptr + query * dim + i));
          outs[g] = out_ptr + query * dim;
        }
        attend_group(queries.data(), static_cast<int>(group), k_ptr + b * kc.stride(0) + kv * kc.stride(1),
                     v_ptr + b * vc.stride(0) + kv * vc.stride(1), count[b * tokens + t], dim, chunks, scale,
                     scores.data(), stride_scores, outs);
      }
    });
  };
  dispatch_float_or_bfloat16(q.scalar_type(), run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(verispec, m) {
  m.def("attend(Tensor q, Tensor keys, Tensor values, Tensor counts) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("attend", &attend);
}
