// bfloat16 <-> float32, 16 lanes at a time (AVX-512F), shared by verispec's kernels.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

// float32 -> bfloat16 bits, rounding to nearest even: what c10::BFloat16(float) and aten's .to() do
// for every finite value (NaN aside).
inline __m256i to_bfloat16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// bfloat16 bits -> float32, exactly: the bits move up 16.
inline __m512 from_bfloat16(const void* p) {
  const __m256i bits = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 elements of a float32 or bfloat16 tensor as float32 lanes, and back (rounding to nearest even).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return from_bfloat16(p); }

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bfloat16(v)); }

// run(static_cast<T*>(nullptr)) with T the element type of a float32 or bfloat16 tensor (checked by the caller).
template <typename Run>
void dispatch_float_or_bfloat16(at::ScalarType dtype, const Run& run) {
  if (dtype == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else {
    run(static_cast<at::BFloat16*>(nullptr));
  }
}
