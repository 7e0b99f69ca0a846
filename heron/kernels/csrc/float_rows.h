// Float32 working rows for heron's CPU kernels: bfloat16/float16 <-> float32 conversion of whole rows and an
// e^x in plain arithmetic, all written so that the compiler vectorizes the loops that use them.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>

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

// Rows in and out of float32 working buffers (vectorized loops).
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f32(src + i);
}
template <typename T>
inline void store_row(const float* src, T* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) from_f32(dst + i, src[i]);
}

// e^x to float32 precision (relative error < 4e-7) in plain arithmetic, so a loop of it vectorizes:
// 2^n * e^r with n = round(x / ln 2) and a degree-6 polynomial for e^r, |r| <= ln(2) / 2.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * float_of(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace heron
