// 16 float32 lanes, shared by verispec's kernels: one AVX-512 register, or two AVX2 ones on CPUs
// without AVX-512 (AMD EPYC Zen 2, say). The kernels are written once against these functions and
// built for the CPU at hand (see verispec.models.w4a8). Each function does the same float operations
// lane by lane on both; only the order of v_sum's additions differs between them, fixed on each.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__)

using vec16 = __m512;

inline vec16 v_zero() { return _mm512_setzero_ps(); }
inline vec16 v_set1(float x) { return _mm512_set1_ps(x); }
inline vec16 v_add(vec16 a, vec16 b) { return _mm512_add_ps(a, b); }
inline vec16 v_sub(vec16 a, vec16 b) { return _mm512_sub_ps(a, b); }
inline vec16 v_mul(vec16 a, vec16 b) { return _mm512_mul_ps(a, b); }
inline vec16 v_div(vec16 a, vec16 b) { return _mm512_div_ps(a, b); }
inline vec16 v_max(vec16 a, vec16 b) { return _mm512_max_ps(a, b); }
inline vec16 v_fmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fmadd_ps(a, b, c); }  // a * b + c, one rounding
inline vec16 v_fnmadd(vec16 a, vec16 b, vec16 c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline vec16 v_round(vec16 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vec16 v_scale_by_power_of_two(vec16 p, vec16 n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
inline float v_sum(vec16 a) { return _mm512_reduce_add_ps(a); }
inline vec16 v_load(const float* p) { return _mm512_loadu_ps(p); }
inline void v_store(float* p, vec16 v) { _mm512_storeu_ps(p, v); }
inline __mmask16 first_lanes(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
inline vec16 v_load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(first_lanes(n), p); }  // rest 0
inline void v_store_first(float* p, int64_t n, vec16 v) { _mm512_mask_storeu_ps(p, first_lanes(n), v); }
inline vec16 v_keep_first(vec16 v, int64_t n) { return _mm512_maskz_mov_ps(first_lanes(n), v); }  // rest 0

// float32 -> bfloat16 bits, rounding to nearest even: what c10::BFloat16(float) and aten's .to() do
// for every finite value (NaN aside).
inline __m256i to_bfloat16(vec16 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// bfloat16 bits -> float32, exactly: the bits move up 16.
inline vec16 from_bfloat16(const void* p) {
  const __m256i bits = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// v rounded to bfloat16 and back: the rounding an aten op in bfloat16 makes.
inline vec16 v_round_to_bfloat16(vec16 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bfloat16(v)), 16));
}

#else  // AVX2 and FMA: two 8-lane halves

struct vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};

inline vec16 v_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vec16 v_set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline vec16 v_add(vec16 a, vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vec16 v_sub(vec16 a, vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vec16 v_mul(vec16 a, vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vec16 v_div(vec16 a, vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline vec16 v_max(vec16 a, vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline vec16 v_fmadd(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vec16 v_fnmadd(vec16 a, vec16 b, vec16 c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline vec16 v_round(vec16 a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
// p * 2^n for integral n in -126..127: 2^n built in the exponent bits, then one exact multiply
// (scalef's result, except where it falls below the normal range).
inline __m256 scale_half(__m256 p, __m256 n) {
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
inline vec16 v_scale_by_power_of_two(vec16 p, vec16 n) { return {scale_half(p.lo, n.lo), scale_half(p.hi, n.hi)}; }
inline float v_sum(vec16 a) {  // lanes i and i + 8, then halves of what is left, in this order
  const __m256 eight = _mm256_add_ps(a.lo, a.hi);
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}
inline vec16 v_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void v_store(float* p, vec16 v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline vec16 v_load_first(const float* p, int64_t n) {  // lanes n.. are 0
  alignas(32) float lanes[16] = {};
  for (int64_t i = 0; i < n && i < 16; ++i) lanes[i] = p[i];
  return v_load(lanes);
}
inline void v_store_first(float* p, int64_t n, vec16 v) {
  alignas(32) float lanes[16];
  v_store(lanes, v);
  for (int64_t i = 0; i < n && i < 16; ++i) p[i] = lanes[i];
}
inline vec16 v_keep_first(vec16 v, int64_t n) {  // lanes n.. set to 0
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i count = _mm256_set1_epi32(static_cast<int>(n < 16 ? n : 16));
  const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, index));
  const __m256 hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(count, _mm256_add_epi32(index, _mm256_set1_epi32(8))));
  return {_mm256_and_ps(v.lo, lo), _mm256_and_ps(v.hi, hi)};
}

// float32 bits rounded to nearest even in the upper 16 (lower 16 left as they fall), per lane.
inline __m256i rounded_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
}

// float32 -> bfloat16 bits, rounding to nearest even (finite values), as the AVX-512 version.
inline __m256i to_bfloat16(vec16 v) {
  const __m256i lo = _mm256_srli_epi32(rounded_bits(v.lo), 16), hi = _mm256_srli_epi32(rounded_bits(v.hi), 16);
  // packus interleaves the 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7): put them back in order.
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
}

inline __m256 widen_bfloat16(__m128i bits) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline vec16 from_bfloat16(const void* p) {
  const __m128i* q = static_cast<const __m128i*>(p);
  return {widen_bfloat16(_mm_loadu_si128(q)), widen_bfloat16(_mm_loadu_si128(q + 1))};
}

inline vec16 v_round_to_bfloat16(vec16 v) {
  const __m256i upper = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return {_mm256_castsi256_ps(_mm256_and_si256(rounded_bits(v.lo), upper)),
          _mm256_castsi256_ps(_mm256_and_si256(rounded_bits(v.hi), upper))};
}

#endif

// 16 elements of a float32 or bfloat16 tensor as float32 lanes, and back (rounding to nearest even).
inline vec16 load16(const float* p) { return v_load(p); }
inline vec16 load16(const at::BFloat16* p) { return from_bfloat16(p); }

inline void store16(float* p, vec16 v) { v_store(p, v); }
inline void store16(at::BFloat16* p, vec16 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bfloat16(v)); }

// v rounded to the storage type and back: the rounding an aten op in that dtype makes.
inline vec16 round_to(const float*, vec16 v) { return v; }
inline vec16 round_to(const at::BFloat16*, vec16 v) { return v_round_to_bfloat16(v); }

// run(static_cast<T*>(nullptr)) with T the element type of a float32 or bfloat16 tensor (checked by the caller).
template <typename Run>
void dispatch_float_or_bfloat16(at::ScalarType dtype, const Run& run) {
  if (dtype == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<at::BFloat16*>(nullptr));
  }
}
