// Float32 working rows for heron's CPU kernels: bfloat16/float16/float8 <-> float32 conversion of whole rows
// and an e^x in plain arithmetic, all written so that the compiler vectorizes the loops that use them.
#pragma once

// ATen's tensor, dispatch and parallel headers only: torch/extension.h (torch's whole C++ frontend and pybind11)
// took ~28 s of compiling per file on Zen 4, these ~2 s. The files with Python bindings (cpu_ops.cpp,
// decoder_stack.cpp) add pybind11 and ATen's type casters from torch/csrc/utils/pybind.h (~9 s).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

// AT_DISPATCH over the dtypes a model computes in (heron/engine/memory.py): float32, bfloat16 and float16. Not
// double, whose instantiations of every kernel only cost compiling time.
#define HERON_DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                                    \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                              \
                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__) AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace heron {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// float32 -> bfloat16 bits, round to nearest even (as c10::BFloat16), NaN kept NaN; written to vectorize
inline uint16_t bf16_bits(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? uint16_t(0x7fc0) : static_cast<uint16_t>(rounded);
}

template <typename T>
inline float to_f32(const T* p) { return static_cast<float>(*p); }
inline float to_f32(const at::BFloat16* p) {
  return float_of(static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(p)) << 16);
}
template <typename T>
inline void from_f32(T* p, float v) { *p = static_cast<T>(v); }
inline void from_f32(at::BFloat16* p, float v) { *reinterpret_cast<uint16_t*>(p) = bf16_bits(v); }
template <typename T>
inline float round_to(T, float v) { return static_cast<float>(static_cast<T>(v)); }
inline float round_to(float, float v) { return v; }
inline float round_to(at::BFloat16, float v) { return float_of(static_cast<uint32_t>(bf16_bits(v)) << 16); }

// float8 (e4m3fn, e5m2: an fp8 KV pool). Reads use integer arithmetic and bit masks, so a row's loop vectorizes
// (GCC does not if-convert c10's branches, nor a ?: between floats): a normal number's exponent and mantissa
// bits move into a float32's, rebiased; a subnormal is its mantissa times the smallest subnormal; the special
// codes map to float32's (e4m3fn has NaN only, e5m2 infinities too). Writes saturate to the format's finite
// range, as the PyTorch form (quantization/kv.py) does: c10's conversion alone turns an e5m2 overflow into
// infinity. NaN stays NaN.
inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t mask = 0u - static_cast<uint32_t>(c);
  return (a & mask) | (b & ~mask);
}
inline float to_f32(const c10::Float8_e4m3fn* p) {  // bias 7, 3 mantissa bits
  const uint32_t b = *reinterpret_cast<const uint8_t*>(p), m = b & 0x7fu;
  const uint32_t normal = select_bits(m == 0x7fu, 0x7fc00000u, (m << 20) + (120u << 23));
  return float_of(select_bits(m < 8u, bits_of(static_cast<float>(m) * 0x1p-9f), normal) | ((b & 0x80u) << 24));
}
inline float to_f32(const c10::Float8_e5m2* p) {  // bias 15, 2 mantissa bits
  const uint32_t b = *reinterpret_cast<const uint8_t*>(p), m = b & 0x7fu;
  const uint32_t normal = select_bits(m >= 0x7cu, (m << 21) | 0x7f800000u, (m << 21) + (112u << 23));
  return float_of(select_bits(m < 4u, bits_of(static_cast<float>(m) * 0x1p-16f), normal) | ((b & 0x80u) << 24));
}
template <typename F8>
inline F8 saturate_to(float v) {
  const float limit = static_cast<float>(std::numeric_limits<F8>::max());
  return F8(std::min(std::max(v, -limit), limit));
}
inline void from_f32(c10::Float8_e4m3fn* p, float v) { *p = saturate_to<c10::Float8_e4m3fn>(v); }
inline void from_f32(c10::Float8_e5m2* p, float v) { *p = saturate_to<c10::Float8_e5m2>(v); }

// Rows in and out of float32 working buffers (vectorized loops).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src + i);
}

#if defined(__F16C__) && defined(__AVX2__)
// Eight float8 codes through float16 and F16C's conversion: a third of the instructions of the bit form above.
inline __m128i load8(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }
inline __m256 to_f32x8(const c10::Float8_e5m2* p) {  // e5m2 is float16's upper byte
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(load8(p)), 8));
}
inline __m256 to_f32x8(const c10::Float8_e4m3fn* p) {
  // sign-extended and shifted, exponent and mantissa land one bit lower than float16's (the bit between them and
  // the sign cleared): the float16 is 2^-8 of the value, subnormals included; the NaN code gets float16's NaN
  const __m128i w = _mm_cvtepi8_epi16(load8(p));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(static_cast<int16_t>(0xbf80)));
  const __m128i m = _mm_and_si128(w, _mm_set1_epi16(0x7f));
  const __m128i nan = _mm_and_si128(_mm_cmpeq_epi16(m, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00));
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(h, nan)), _mm256_set1_ps(256.0f));
}
#endif
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX2__)
// The same, sixteen codes at a time (one float16 -> float32 conversion of a whole AVX-512 register).
inline __m128i load16(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m512 to_f32x16(const c10::Float8_e5m2* p) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load16(p)), 8));
}
inline __m512 to_f32x16(const c10::Float8_e4m3fn* p) {
  const __m256i w = _mm256_cvtepi8_epi16(load16(p));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(static_cast<int16_t>(0xbf80)));
  const __m256i m = _mm256_and_si256(w, _mm256_set1_epi16(0x7f));
  const __m256i nan = _mm256_and_si256(_mm256_cmpeq_epi16(m, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7c00));
  return _mm512_mul_ps(_mm512_cvtph_ps(_mm256_or_si256(h, nan)), _mm512_set1_ps(256.0f));
}
#endif
template <typename F8>
inline void load_fp8_row(const F8* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__) && defined(__F16C__) && defined(__AVX2__)
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, to_f32x16(src + i));
#endif
#if defined(__F16C__) && defined(__AVX2__)
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, to_f32x8(src + i));
#endif
  for (; i < n; ++i) dst[i] = to_f32(src + i);
}
inline void load_row(const c10::Float8_e4m3fn* src, float* dst, int64_t n) { load_fp8_row(src, dst, n); }
inline void load_row(const c10::Float8_e5m2* src, float* dst, int64_t n) { load_fp8_row(src, dst, n); }
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) from_f32(dst + i, src[i]);
}

// e^x to float32 precision (relative error < 4e-7) in plain arithmetic, so a loop of it vectorizes:
// 2^n * e^r with n = round(x / ln 2) and a degree-6 polynomial for e^r, |r| <= ln(2) / 2. n is rounded by adding
// 1.5 * 2^23 (its low bits then hold n), not by std::floor, which GCC 12 leaves scalar without -fno-trapping-math.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  constexpr float kRound = 12582912.0f;
  const float t = x * 1.44269504f + kRound;
  const float n = t - kRound;
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * float_of((bits_of(t) - bits_of(kRound) + 127u) << 23);
}

}  // namespace heron
