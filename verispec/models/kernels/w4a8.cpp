// w4a8 linear for short passes: 4-bit weights times int8 activations, integer dot products (AVX-512 VNNI,
// or AVX2 where the CPU has no AVX-512: the same exact integers, so the same bits).
//
// Weights are int8 values w[n, k] = m[n, g] * q[n, k] + o[n, g] with q in -8..7 (stored as q + 8 in a
// nibble), an integer multiplier m in 1..16 and an integer offset o per group g of 32 inputs (an
// asymmetric 4-bit grid, like llama.cpp's Q4_1), times a float scale s[n] per output row. Activations
// are int8 xq[r, k] with a float scale sx[r] per row. So
//   y[r, n] = (float(A[r, n]) * s[n]) * sx[r]
//   A = sum_g m[n, g] * sum_{k in g} xq[r, k] * q[n, k] + o[n, g] * sum_{k in g} xq[r, k]
// where A is an exact int32: the very integer that oneDNN's int8 matmul computes from the same
// int8 weights, followed by the same two float roundings. This kernel reads about half the bytes of
// the int8 weights, for passes of a few rows; longer passes go to oneDNN with the int8 weights, and
// every row gets the same bits either way (verispec's batch invariance).
//
// Packed layout, (N / 16, K / 32, 288) bytes: for each block of 16 output columns and each group
// of 32 inputs, 256 bytes of nibbles, then the 16 columns' multipliers (uint8), then their offsets
// (int8). Byte 64 * j + 4 * c + r holds q[c, 8 j + r] + 8 in its low nibble and q[c, 8 j + 4 + r] + 8
// in its high nibble (c: column in the block, r: 0..3): each nibble plane is a vpdpbusd operand (with
// AVX2, two vpmaddubsw operands of 8 columns each).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "vec16.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kCols = 16;
constexpr int64_t kNibbleBytes = 256;
constexpr int64_t kBlockBytes = kNibbleBytes + 2 * kCols;  // nibbles, multipliers, offsets
constexpr int kRowsPerPass = 8;  // a verify pass of up to 8 rows reads the weights once
constexpr int64_t kPrefetchBytes = 8 * kBlockBytes;

#if defined(__AVX512F__)

using Totals = __m512i;  // a column block's 16 exact int32 sums for one row
inline vec16 to_float(Totals total) { return _mm512_cvtepi32_ps(total); }

// acc + u8 weights times the 4 int8 activations at p, broadcast to every lane: vpdpbusd with its
// memory operand broadcast. GCC emits _mm512_set1_epi32 of a load as a separate vpbroadcastd, one
// more vector op per vpdpbusd: 8-row passes ran ~15% slower that way (AMD EPYC Zen 4).
inline __m512i dot_broadcast(__m512i acc, __m512i weights, const int8_t* p) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(weights), "m"(*reinterpret_cast<const int32_t*>(p)));
  return acc;
}

// One block of 16 output columns for `Rows` rows. xq: (G, Rows, 32) int8, each group's activations
// of every row side by side (see interleave); sums: (G, Rows) int32 holding each group's activation
// sum S as S * 2^16 + 2^15 - 8 S (see group_sums). One pointer per group: every row's operand is a
// fixed displacement from it.
template <int Rows>
void column_block(const uint8_t* packed, int64_t groups, const int8_t* xq, const int32_t* sums, Totals* totals) {
  __m512i acc[Rows];
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_si512();
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i flip = _mm512_set1_epi32(0x8000);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = packed + g * kBlockBytes;
    for (int line = 0; line < kBlockBytes; line += 64) {  // ahead into L1 and further ahead into L2
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + 4 * kPrefetchBytes + line), _MM_HINT_T1);
    }
    __m512i w[8];
    for (int j = 0; j < 4; ++j) {
      const __m512i p = _mm512_loadu_si512(block + 64 * j);
      w[2 * j] = _mm512_and_si512(p, low4);
      w[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low4);
    }
    // Per int32 lane (a column): m in the low 16 bits, o in the high 16.
    const __m512i multiplier = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleBytes)));
    const __m512i offset = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kNibbleBytes + kCols)));
    const __m512i factors = _mm512_or_si512(multiplier, _mm512_slli_epi32(offset, 16));
    const int8_t* xg = xq + g * Rows * kGroup;
    const int32_t* sg = sums + g * Rows;
    // sum_k (q + 8) * xq from S * 2^16 + 2^15 - 8 S leaves S * 2^16 + 2^15 + dot, dot = sum_k q * xq;
    // |dot| <= 32 * 8 * 127 < 2^15, so the high 16 bits hold S and the low 16 bits dot + 2^15. The rows'
    // chains interleave, so that independent dot products sit side by side for the out-of-order core.
    __m512i dot[Rows];
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) dot[r] = dot_broadcast(_mm512_set1_epi32(sg[r]), w[0], xg + r * kGroup);
#pragma GCC unroll 8
    for (int j = 1; j < 8; ++j) {
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) dot[r] = dot_broadcast(dot[r], w[j], xg + r * kGroup + 4 * j);
    }
    // Flipping bit 15 makes the low half dot as a signed 16-bit number; vpdpwssd by (m, o) then adds
    // m * dot + o * S.
#pragma GCC unroll 8
    for (int r = 0; r < Rows; ++r) acc[r] = _mm512_dpwssd_epi32(acc[r], _mm512_xor_si512(dot[r], flip), factors);
  }
#pragma GCC unroll 8
  for (int r = 0; r < Rows; ++r) totals[r] = acc[r];
}

#else  // AVX2: each block's 16 columns as two halves of 8, one 32-byte line of nibbles each

struct Totals {
  __m256i lo, hi;  // columns 0-7, 8-15
};
inline vec16 to_float(Totals total) { return {_mm256_cvtepi32_ps(total.lo), _mm256_cvtepi32_ps(total.hi)}; }

// The AVX-512 column_block's arithmetic without VNNI. vpmaddubsw multiplies the stored nibbles (q + 8,
// 0..15) by the activations and adds pairs into 16 bits: |2 * 15 * 127| per pair, at most 30480 over
// a group's 8 planes, so nothing saturates; vpmaddwd by ones then sums each column's 32 products
// exactly (dot + 8 S), and by (m, o) adds m * dot + o * S as vpdpwssd does.
template <int Rows>
void column_block(const uint8_t* packed, int64_t groups, const int8_t* xq, const int32_t* sums, Totals* totals) {
  __m256i acc[2][Rows];
  for (int half = 0; half < 2; ++half) {
    for (int r = 0; r < Rows; ++r) acc[half][r] = _mm256_setzero_si256();
  }
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i flip = _mm256_set1_epi32(0x8000);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* block = packed + g * kBlockBytes;
    for (int line = 0; line < kBlockBytes; line += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(block + kPrefetchBytes + line), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(block + 4 * kPrefetchBytes + line), _MM_HINT_T1);
    }
    const int8_t* xg = xq + g * Rows * kGroup;
    const int32_t* sg = sums + g * Rows;
    for (int half = 0; half < 2; ++half) {
      __m256i w[8];
      for (int j = 0; j < 4; ++j) {
        const __m256i p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j + 32 * half));
        w[2 * j] = _mm256_and_si256(p, low4);
        w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low4);
      }
      const uint8_t* factor_bytes = block + kNibbleBytes + 8 * half;  // this half's 8 multipliers; offsets 16 on
      const __m128i multipliers = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(factor_bytes));
      const __m128i offsets = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(factor_bytes + kCols));
      const __m256i multiplier = _mm256_cvtepu8_epi32(multipliers);
      const __m256i offset = _mm256_cvtepi8_epi32(offsets);
      const __m256i factors = _mm256_or_si256(multiplier, _mm256_slli_epi32(offset, 16));
#pragma GCC unroll 8
      for (int r = 0; r < Rows; ++r) {
        const int8_t* x = xg + r * kGroup;
        int32_t four;
        std::memcpy(&four, x, 4);
        __m256i pairs = _mm256_maddubs_epi16(w[0], _mm256_set1_epi32(four));
#pragma GCC unroll 8
        for (int j = 1; j < 8; ++j) {
          std::memcpy(&four, x + 4 * j, 4);
          pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(four)));
        }
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(pairs, ones), _mm256_set1_epi32(sg[r]));
        acc[half][r] = _mm256_add_epi32(acc[half][r], _mm256_madd_epi16(_mm256_xor_si256(dot, flip), factors));
      }
    }
  }
  for (int r = 0; r < Rows; ++r) totals[r] = {acc[0][r], acc[1][r]};
}

#endif

using BlockFunction = void (*)(const uint8_t*, int64_t, const int8_t*, const int32_t*, Totals*);
constexpr BlockFunction kBlockFunctions[kRowsPerPass] = {column_block<1>, column_block<2>, column_block<3>,
                                                         column_block<4>, column_block<5>, column_block<6>,
                                                         column_block<7>, column_block<8>};

// Each group's activation sum S (|S| <= 32 * 127) as S * 2^16 + 2^15 - 8 S: the start of column_block's
// sums (-8 S takes back what the + 8 of the stored nibbles adds; 2^15 keeps the low half non-negative).
void group_sums(const int8_t* xq, int64_t rows, int64_t groups, int32_t* sums) {
  for (int64_t rg = 0; rg < rows * groups; ++rg) {
    const int8_t* xg = xq + rg * kGroup;  // (r, g) is row-major, as xq's groups are
    int32_t sum = 0;
    for (int i = 0; i < kGroup; ++i) sum += xg[i];
    sums[rg] = sum * 65536 + 32768 - 8 * sum;
  }
}

// What to do with a column block's 16 exact sums A of one row: y = float(A) * weight_scale, and for
// a whole linear then ((y * row_scale) + bias) in the output dtype, the same float operations in the
// same order as finish() below, so the fused and the oneDNN paths round alike.
struct Epilogue {
  const float* weight_scale;  // (N,)
  const float* row_scale = nullptr;  // (M,) or nullptr: stop at y, in float32
  const float* bias = nullptr;  // (N,) or nullptr
  bool bfloat16_out = false;
  void* out;  // (M, N) float32 or bfloat16
  int64_t n;

  void store(int64_t row, int64_t column, Totals total) const {
    vec16 y = v_mul(to_float(total), v_load(weight_scale + column));
    if (row_scale != nullptr) {
      y = v_mul(y, v_set1(row_scale[row]));
      if (bias != nullptr) y = v_add(y, v_load(bias + column));
    }
    if (bfloat16_out) {
      store16(static_cast<at::BFloat16*>(out) + row * n + column, y);
    } else {
      v_store(static_cast<float*>(out) + row * n + column, y);
    }
  }
};

// Passes of up to 8 rows, each laid out as column_block reads it: xq (M, K) -> (passes: G, rows, 32),
// sums (M, G) -> (passes: G, rows).
void interleave(const int8_t* xq, const int32_t* sums, int64_t rows, int64_t groups, int8_t* xq_out,
                int32_t* sums_out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
    const int64_t count = std::min<int64_t>(kRowsPerPass, rows - r0);
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r = 0; r < count; ++r) {
        std::memcpy(xq_out + (r0 * groups + g * count + r) * kGroup, xq + ((r0 + r) * groups + g) * kGroup, kGroup);
        sums_out[r0 * groups + g * count + r] = sums[(r0 + r) * groups + g];
      }
    }
  }
}

// xq: (M, K) int8, sums: (M, K / 32) from group_sums, packed: (N / 16, K / 32, 288): every row's
// 16-column blocks, stored through the epilogue. Up to 8 rows share one read of the weights.
void run_kernel(const int8_t* xq, const int32_t* sums, int64_t rows, int64_t k, const uint8_t* packed,
                int64_t column_blocks, const Epilogue& epilogue) {
  const int64_t groups = k / kGroup;
  std::vector<int8_t> xq_passes(rows * k);
  std::vector<int32_t> sums_passes(rows * groups);
  interleave(xq, sums, rows, groups, xq_passes.data(), sums_passes.data());
  at::parallel_for(0, column_blocks, 1, [&](int64_t begin, int64_t end) {
    Totals totals[kRowsPerPass];
    for (int64_t cb = begin; cb < end; ++cb) {
      for (int64_t r0 = 0; r0 < rows; r0 += kRowsPerPass) {
        const int64_t count = std::min<int64_t>(kRowsPerPass, rows - r0);
        kBlockFunctions[count - 1](packed + cb * groups * kBlockBytes, groups, xq_passes.data() + r0 * k,
                                   sums_passes.data() + r0 * groups, totals);
        for (int64_t r = 0; r < count; ++r) epilogue.store(r0 + r, cb * kCols, totals[r]);
      }
    }
  });
}

void check_weights(const at::Tensor& packed, const at::Tensor& weight_scale, int64_t k) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlockBytes && packed.scalar_type() == at::kByte,
              "w4a8: packed weights must be (N/16, K/32, 288) uint8");
  TORCH_CHECK(k == packed.size(1) * kGroup, "w4a8: the activations have ", k, " inputs, the weights ",
              packed.size(1) * kGroup);
  TORCH_CHECK(weight_scale.numel() == packed.size(0) * kCols && weight_scale.scalar_type() == at::kFloat,
              "w4a8: weight_scale must be (N,) float32");
}

// xq: (M, K) int8, the activations already quantized; packed: (N / 16, K / 32, 288) uint8;
// weight_scale: (N,) float32. Returns (M, N) float32: float(A) * weight_scale, as oneDNN gives it.
at::Tensor w4a8_matmul(const at::Tensor& xq, const at::Tensor& packed, const at::Tensor& weight_scale) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar, "w4a8_matmul: xq must be (M, K) int8");
  check_weights(packed, weight_scale, xq.size(1));
  const int64_t rows = xq.size(0), k = xq.size(1), n = packed.size(0) * kCols;
  const at::Tensor x = xq.contiguous(), w = packed.contiguous(), scale = weight_scale.contiguous();
  std::vector<int32_t> sums(rows * (k / kGroup));
  group_sums(x.data_ptr<int8_t>(), rows, k / kGroup, sums.data());
  at::Tensor y = at::empty({rows, n}, xq.options().dtype(at::kFloat));
  Epilogue epilogue{scale.data_ptr<float>()};
  epilogue.out = y.data_ptr<float>();
  epilogue.n = n;
  run_kernel(x.data_ptr<int8_t>(), sums.data(), rows, k, w.data_ptr<uint8_t>(), packed.size(0), epilogue);
  return y;
}

// One row of activations -> int8 codes (or uint8 codes + 128) and its scale, amax / 127.
template <typename scalar_t, typename code_t>
float quantize_row_of_activations(const scalar_t* x, int64_t k, code_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < k; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = std::max(amax, 1e-12f) / 127.f;
  const float shift = std::is_same<code_t, uint8_t>::value ? 128.f : 0.f;
  for (int64_t i = 0; i < k; ++i) {
    const float code = std::min(127.f, std::max(-127.f, std::nearbyint(static_cast<float>(x[i]) / scale)));
    q[i] = static_cast<code_t>(code + shift);
  }
  return scale;
}

// Every row of x (M, K), contiguous, into q (M, K) codes and scales (M,). Every w4a8 pass, one row or
// many, quantizes its activations here, so a row gets the same integers either way.
template <typename code_t>
void quantize_activations(const at::Tensor& x, code_t* q, float* scales) {
  const int64_t rows = x.size(0), k = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "w4a8_quantize_rows", [&] {
    const scalar_t* x_ptr = x.data_ptr<scalar_t>();
    for (int64_t r = 0; r < rows; ++r) scales[r] = quantize_row_of_activations(x_ptr + r * k, k, q + r * k);
  });
}

// Per row: int8 values (or uint8 values + 128) and one float scale, amax / 127.
std::tuple<at::Tensor, at::Tensor> quantize_rows(const at::Tensor& x, bool unsigned_values) {
  TORCH_CHECK(x.dim() == 2, "w4a8: activations must be (M, K)");
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty(xc.sizes(), xc.options().dtype(unsigned_values ? at::kByte : at::kChar));
  at::Tensor row_scale = at::empty({xc.size(0), 1}, xc.options().dtype(at::kFloat));
  if (unsigned_values) {
    quantize_activations(xc, q.data_ptr<uint8_t>(), row_scale.data_ptr<float>());
  } else {
    quantize_activations(xc, q.data_ptr<int8_t>(), row_scale.data_ptr<float>());
  }
  return {q, row_scale};
}

// y (M, N) float32 exact sums times weight scales -> (y * row_scale + bias) in `dtype`.
at::Tensor finish(const at::Tensor& y, const at::Tensor& row_scale, const c10::optional<at::Tensor>& bias,
                  at::ScalarType dtype) {
  at::Tensor out = y.mul(row_scale);
  if (bias.has_value() && bias->defined()) out.add_(*bias);
  return out.to(dtype);
}

// One w4a8 linear over the 4-bit codes: x (M, K) -> (M, N) in x's dtype, in one call: activations
// quantized as quantize_rows does, the kernel, and finish()'s arithmetic in the kernel's stores.
// Passes with more rows than the kernel wins on go to oneDNN (see verispec.models.linear) through
// quantize_rows and finish, so a row gets the same bits either way.
at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& weight_scale,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "w4a8: activations must be (M, K)");
  const bool has_bias = bias.has_value() && bias->defined();
  const bool fused = x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat;
  if (!fused || (has_bias && bias->scalar_type() != at::kFloat)) {
    auto [q, row_scale] = quantize_rows(x, false);
    return finish(w4a8_matmul(q, packed, weight_scale), row_scale, bias, x.scalar_type());
  }
  check_weights(packed, weight_scale, x.size(1));
  const at::Tensor xc = x.contiguous(), w = packed.contiguous(), scale = weight_scale.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), groups = k / kGroup, n = packed.size(0) * kCols;
  std::vector<int8_t> xq(rows * k);
  std::vector<float> row_scale(rows);
  std::vector<int32_t> sums(rows * groups);
  quantize_activations(xc, xq.data(), row_scale.data());
  group_sums(xq.data(), rows, groups, sums.data());
  at::Tensor out = at::empty({rows, n}, xc.options());
  at::Tensor bias_values = has_bias ? bias->contiguous() : at::Tensor();
  Epilogue epilogue{scale.data_ptr<float>(), row_scale.data(), has_bias ? bias_values.data_ptr<float>() : nullptr,
                    x.scalar_type() == at::kBFloat16, out.data_ptr(), n};
  run_kernel(xq.data(), sums.data(), rows, k, w.data_ptr<uint8_t>(), packed.size(0), epilogue);
  return out;
}

constexpr float kRowLevels = 120.f;  // a row's largest |w| is 120 int8 steps: 15 steps of m = 16 span the row
constexpr int kMultiplierMax = 16;    // o - 8 m >= -128 and o + 7 m <= 127 then leave room for an offset

// One row: int8 values m * q + o, the codes q + 8 and each group's m and o written into the packed
// blocks, the row's scale. Each group keeps, among the multipliers around its ideal step (range / 15)
// and the offsets around the one that centres its range, the pair with the least squared error
// (rounding q to the nearest code, clamped to -8..7).
template <typename scalar_t>
void quantize_row(const scalar_t* w, int64_t k, int8_t* int8_row, float* scale, uint8_t* packed_row, int64_t column,
                  std::vector<float>& v) {
  float row_max = 0.f;
  for (int64_t i = 0; i < k; ++i) {
    v[i] = static_cast<float>(w[i]);
    row_max = std::max(row_max, std::fabs(v[i]));
  }
  const float s = std::max(row_max, 1e-12f) / kRowLevels;
  *scale = s;
  for (int64_t i = 0; i < k; ++i) v[i] /= s;
  const auto code = [](float value, int m, int o) {
    return static_cast<int>(std::min(7.f, std::max(-8.f, std::nearbyint((value - o) / m))));
  };
  const int64_t groups = k / kGroup;
  for (int64_t g = 0; g < groups; ++g) {
    const float* vg = v.data() + g * kGroup;
    const auto [low, high] = std::minmax_element(vg, vg + kGroup);
    const int ideal = static_cast<int>(std::ceil(std::max(1.f, (*high - *low) / 15.f)));
    int best_m = 1, best_o = 0;
    float best_error = INFINITY;
    for (int m = std::max(1, ideal - 1); m <= std::min(kMultiplierMax, ideal + 1); ++m) {
      const int centred = static_cast<int>(std::nearbyint((*high + *low) / 2 + m / 2.f));
      for (int o = std::max(centred - 1, -128 + 8 * m); o <= std::min(centred + 1, 127 - 7 * m); ++o) {
        float error = 0.f;
        for (int i = 0; i < kGroup; ++i) {
          const float d = vg[i] - static_cast<float>(code(vg[i], m, o) * m + o);
          error += d * d;
        }
        if (error < best_error) best_error = error, best_m = m, best_o = o;
      }
    }
    uint8_t* block = packed_row + g * kBlockBytes;
    block[kNibbleBytes + column] = static_cast<uint8_t>(best_m);
    block[kNibbleBytes + kCols + column] = static_cast<uint8_t>(static_cast<int8_t>(best_o));
    for (int i = 0; i < kGroup; ++i) {
      const int q = code(vg[i], best_m, best_o);
      int8_row[g * kGroup + i] = static_cast<int8_t>(q * best_m + best_o);
      const int j = i / 8, high_nibble = (i % 8) / 4, r = i % 4;
      uint8_t& byte = block[64 * j + 4 * column + r];
      byte = high_nibble ? (byte & 0x0F) | ((q + 8) << 4) : (byte & 0xF0) | (q + 8);
    }
  }
}

// weight (N, K) -> int8 (N, K) = m * q + o, scale (N,) float32, packed (N / 16, K / 32, 288) uint8.
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_quantize(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "w4a8_quantize: weight must be (N, K)");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kCols == 0 && k % kGroup == 0, "w4a8_quantize: N must be a multiple of 16 and K of 32");
  const at::Tensor w = weight.contiguous();
  at::Tensor int8 = at::empty({n, k}, w.options().dtype(at::kChar));
  at::Tensor scale = at::empty({n}, w.options().dtype(at::kFloat));
  at::Tensor packed = at::zeros({n / kCols, k / kGroup, kBlockBytes}, w.options().dtype(at::kByte));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, w.scalar_type(), "w4a8_quantize", [&] {
    const scalar_t* w_ptr = w.data_ptr<scalar_t>();
    int8_t* int8_ptr = int8.data_ptr<int8_t>();
    float* scale_ptr = scale.data_ptr<float>();
    uint8_t* packed_ptr = packed.data_ptr<uint8_t>();
    // Whole blocks of 16 rows per task: rows of one block write bytes of the same packed blocks.
    at::parallel_for(0, n / kCols, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> v(k);
      for (int64_t row = begin * kCols; row < end * kCols; ++row) {
        quantize_row(w_ptr + row * k, k, int8_ptr + row * k, scale_ptr + row,
                     packed_ptr + (row / kCols) * (k / kGroup) * kBlockBytes, row % kCols, v);
      }
    });
  });
  return {int8, scale, packed};
}

}  // namespace

TORCH_LIBRARY(verispec, m) {
  m.def("w4a8_matmul(Tensor xq, Tensor packed, Tensor weight_scale) -> Tensor");
  m.def("w4a8_quantize(Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("w4a8_quantize_rows(Tensor x, bool unsigned_values) -> (Tensor, Tensor)");
  m.def("w4a8_finish(Tensor y, Tensor row_scale, Tensor? bias, ScalarType dtype) -> Tensor");
  m.def("w4a8_linear(Tensor x, Tensor packed, Tensor weight_scale, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(verispec, CPU, m) {
  m.impl("w4a8_matmul", &w4a8_matmul);
  m.impl("w4a8_quantize", &w4a8_quantize);
  m.impl("w4a8_quantize_rows", &quantize_rows);
  m.impl("w4a8_finish", &finish);
  m.impl("w4a8_linear", &w4a8_linear);
}
