// Integer-weight matmul: y = x W^T (+ bias) with W in heron's packed layout (heron/quantization/packed_int.py):
// w[n, k] = scale[n, g] * q[n, k] + min[n, g], q unsigned 4- or 8-bit, tiles of 16 output rows whose lanes hold
// 4 consecutive inputs. Activations are quantized to int8 per 32 inputs (as llama.cpp's q8 blocks), so
//   sum_k w x ~= sum_g scale_g * sum_b dx_b * sum_{k in b} q_k qx_k + min_g * sum_{k in g} dx qx
// and the inner sum is one AVX-512 VNNI instruction per 16 rows x 4 inputs (u8 weights x s8 activations), or
// two AVX2 instructions per 8 rows x 4 inputs where there is no VNNI.
#include "float_rows.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <vector>

namespace {

constexpr int64_t kRows = 16;      // output rows per tile
constexpr int64_t kActBlock = 32;  // inputs per activation scale
constexpr int64_t kMaxTileRows = 4;  // activation rows sharing one pass over a tile's weights

// Scales and mins are float32, or float16 where a format's are exactly float16 (a fifth fewer bytes to read).
inline float scalar_of(const float* p) { return *p; }
inline float scalar_of(const at::Half* p) { return static_cast<float>(*p); }
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

// Calls ``body`` with a null pointer of the scales' element type (float or at::Half).
template <typename F>
void dispatch_scales(const torch::Tensor& scales, F body) {
  if (scales.scalar_type() == at::kHalf) body(static_cast<const at::Half*>(nullptr));
  else body(static_cast<const float*>(nullptr));
}

// x quantized: int8 values [M, Kp], a scale per 32 inputs [M, Kp/32], and the sum of the dequantized values
// per weight group [M, Kp/G] (the min term, computed from the same rounded values as the dot products).
struct QuantizedActivations {
  std::vector<int8_t> q;
  std::vector<float> scale;
  std::vector<float> group_sum;
  std::vector<int32_t> sum16;  // sum of the int8 values per 16 inputs [M, Kp/16]
};

template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t M, int64_t K, int64_t Kp, int64_t G) {
  QuantizedActivations a{std::vector<int8_t>(M * Kp), std::vector<float>(M * Kp / kActBlock),
                         std::vector<float>(M * Kp / G), std::vector<int32_t>(M * Kp / 16)};
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    float buf[kActBlock];
    for (int64_t m = begin; m < end; ++m) {
      int8_t* q = a.q.data() + m * Kp;
      float* scale = a.scale.data() + m * Kp / kActBlock;
      for (int64_t b = 0; b < Kp / kActBlock; ++b) {
        float amax = 0.f;
        for (int64_t i = 0; i < kActBlock; ++i) {
          const int64_t k = b * kActBlock + i;
          buf[i] = k < K ? heron::to_f32(x + m * K + k) : 0.f;
          amax = std::max(amax, std::abs(buf[i]));
        }
        const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        scale[b] = d;
        for (int64_t i = 0; i < kActBlock; ++i) q[b * kActBlock + i] = static_cast<int8_t>(std::nearbyint(buf[i] * inv));
      }
      int32_t* sum16 = a.sum16.data() + m * Kp / 16;
      for (int64_t s = 0; s < Kp / 16; ++s) {
        int32_t total = 0;
        for (int64_t k = s * 16; k < (s + 1) * 16; ++k) total += q[k];
        sum16[s] = total;
      }
      float* group_sum = a.group_sum.data() + m * Kp / G;
      for (int64_t g = 0; g < Kp / G; ++g) {
        float s = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) s += scale[k / kActBlock] * q[k];
        group_sum[g] = s;
      }
    }
  });
  return a;
}

// Activation rows m0 .. m0 + MT - 1: their int8 values, scales per 32 inputs and sums per weight group.
template <int MT>
struct ActivationRows {
  const int8_t* q[MT];
  const float* scale[MT];
  const float* group_sum[MT];
  const int32_t* sum16[MT];
  // sum of row m's int8 values over inputs [k, k + count), count 16 or 32
  int32_t sum_of(int m, int64_t k, int64_t count) const {
    return count == 16 ? sum16[m][k / 16] : sum16[m][k / 16] + sum16[m][k / 16 + 1];
  }
  ActivationRows(const QuantizedActivations& a, int64_t m0, int64_t Kp, int64_t G) {
    for (int m = 0; m < MT; ++m) {
      q[m] = a.q.data() + (m0 + m) * Kp;
      scale[m] = a.scale.data() + (m0 + m) * Kp / kActBlock;
      group_sum[m] = a.group_sum.data() + (m0 + m) * Kp / G;
      sum16[m] = a.sum16.data() + (m0 + m) * Kp / 16;
    }
  }
};

// Four consecutive int8 activations as one 32-bit lane (to broadcast against 4 inputs of every row).
inline int32_t four_bytes(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }

// out[t][m][16] = the 16 rows of NT consecutive tiles times MT activation rows: int8 dot products into
// 2 * NT * MT independent int32 accumulators (enough chains to hide VPDPBUSD's latency), scaled in float32.
template <int BITS, int MT, int NT, typename S>
void tile_dot(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
              const QuantizedActivations& a, int64_t m0, float* out) {
  constexpr int64_t kStep = BITS == 8 ? 4 : 8;  // inputs per 64-byte step
  const int64_t sub = std::min(G, kActBlock), groups = Kp / G;
  const ActivationRows<MT> rows(a, m0, Kp, G);
  const auto &qx = rows.q, &xs = rows.scale, &gs = rows.group_sum;
  __m512 acc[NT][MT];
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NT; ++t) acc[t][m] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t kb = g * G; kb < (g + 1) * G; kb += sub) {
      __m512i even[NT][MT], odd[NT][MT];
      for (int t = 0; t < NT; ++t)
        for (int m = 0; m < MT; ++m) even[t][m] = odd[t][m] = _mm512_setzero_si512();
      if constexpr (BITS == 8) {
        for (int64_t k = kb; k < kb + sub; k += 2 * kStep) {
          for (int t = 0; t < NT; ++t) {
            const uint8_t* wp = w + t * tile_bytes + (k / kStep) * 64;
            const __m512i v0 = _mm512_loadu_si512(wp), v1 = _mm512_loadu_si512(wp + 64);
            for (int m = 0; m < MT; ++m) {
              even[t][m] = _mm512_dpbusd_epi32(even[t][m], v0, broadcast4(qx[m] + k));
              odd[t][m] = _mm512_dpbusd_epi32(odd[t][m], v1, broadcast4(qx[m] + k + 4));
            }
          }
        }
      } else {
        for (int64_t k = kb; k < kb + sub; k += kStep) {
          for (int t = 0; t < NT; ++t) {
            const __m512i v = _mm512_loadu_si512(w + t * tile_bytes + (k / kStep) * 64);
            const __m512i lo = _mm512_and_si512(v, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            for (int m = 0; m < MT; ++m) {
              even[t][m] = _mm512_dpbusd_epi32(even[t][m], lo, broadcast4(qx[m] + k));
              odd[t][m] = _mm512_dpbusd_epi32(odd[t][m], hi, broadcast4(qx[m] + k + 4));
            }
          }
        }
      }
      for (int t = 0; t < NT; ++t) {
        const __m512 ws = load16(scales + (t * groups + g) * kRows);
        for (int m = 0; m < MT; ++m) {
          const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xs[m][kb / kActBlock]));
          const __m512i dot = _mm512_add_epi32(even[t][m], odd[t][m]);
          acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[t][m]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 ms = load16(mins + (t * groups + g) * kRows);
      for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_fmadd_ps(ms, _mm512_set1_ps(gs[m][g]), acc[t][m]);
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + (t * MT + m) * kRows, acc[t][m]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }

// Bytes ahead of each tile's stream to prefetch: a layer's matrix is short (0.2-1 MB per thread), too short for
// the hardware prefetcher to reach full speed (a model pass 5-10% faster, the 8-bit LM head ~10%, on Zen 3).
constexpr int64_t kPrefetchBytes = 1024;

// Starts fetching the cache line ``kPrefetchBytes`` ahead of ``p``.
inline void prefetch_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchBytes), _MM_HINT_T0);
}

// The same products with AVX2 (no VNNI), over column groups of 8 rows (half a tile, 32 bytes of each 64-byte
// step): VPMADDUBSW (u8 x s8 pairs into int16) then VPMADDWD by ones (4 inputs of a row into its int32 lane), as
// llama.cpp's AVX2 dot products. CG groups share each broadcast activation, so one activation row walks up to
// four groups (two tiles) at once. 4-bit: a 32-input block's int16 pair sums stay below 2**15 (8 x 15 x 127 per
// lane), so they are widened once per block. 8-bit: an unsigned weight x int8 pair could overflow int16, so the
// weight is taken as w - 128 (signed, its magnitude on the unsigned side, its sign moved to x) and 128 * sum(x)
// added back. Integer sums are exact and each output's float32 operations come in the same order for every
// grouping, so a row's result does not depend on how many rows share the pass.
template <int BITS, int MT, int CG, int64_t sub, typename S>
void column_groups(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
                   const ActivationRows<MT>& rows, int c0, float* out) {
  constexpr int64_t kStep = BITS == 8 ? 4 : 8;  // inputs per 64-byte step
  const int64_t groups = Kp / G;
  const __m256i low4 = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const auto &qx = rows.q, &xs = rows.scale, &gs = rows.group_sum;
  const uint8_t* wc[CG];
  int64_t sc[CG];
  for (int c = 0; c < CG; ++c) {
    const int t = (c0 + c) / 2, half = (c0 + c) % 2;
    wc[c] = w + t * tile_bytes + half * 32;
    sc[c] = t * groups * kRows + half * 8;
  }
  __m256 acc[CG][MT];
  for (int c = 0; c < CG; ++c)
    for (int m = 0; m < MT; ++m) acc[c][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t kb = g * G; kb < (g + 1) * G; kb += sub) {
      __m256i dot[CG][MT];
      if constexpr (BITS == 8) {
        for (int c = 0; c < CG; ++c)
          for (int m = 0; m < MT; ++m) dot[c][m] = _mm256_setzero_si256();
        for (int64_t k = kb; k < kb + sub; k += kStep) {
          __m256i bx[MT];
          for (int m = 0; m < MT; ++m) bx[m] = broadcast4(qx[m] + k);
          for (int c = 0; c < CG; ++c) {
            if ((c0 + c) % 2 == 0) prefetch_ahead(wc[c] + (k / kStep) * 64);  // once per 64-byte step
            const __m256i v = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[c] + (k / kStep) * 64)), flip);
            const __m256i magnitude = _mm256_abs_epi8(v);
            for (int m = 0; m < MT; ++m) {
              const __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(bx[m], v));
              dot[c][m] = _mm256_add_epi32(dot[c][m], _mm256_madd_epi16(pairs, ones));
            }
          }
        }
        for (int m = 0; m < MT; ++m) {
          const __m256i back = _mm256_set1_epi32(128 * rows.sum_of(m, kb, sub));
          for (int c = 0; c < CG; ++c) dot[c][m] = _mm256_add_epi32(dot[c][m], back);
        }
      } else {
        __m256i pairs[CG][MT];
        for (int c = 0; c < CG; ++c)
          for (int m = 0; m < MT; ++m) pairs[c][m] = _mm256_setzero_si256();
        for (int64_t k = kb; k < kb + sub; k += kStep) {
          __m256i even[MT], odd[MT];
          for (int m = 0; m < MT; ++m) even[m] = broadcast4(qx[m] + k), odd[m] = broadcast4(qx[m] + k + 4);
          for (int c = 0; c < CG; ++c) {
            if ((c0 + c) % 2 == 0) prefetch_ahead(wc[c] + (k / kStep) * 64);  // once per 64-byte step
            const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wc[c] + (k / kStep) * 64));
            const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int m = 0; m < MT; ++m)
              pairs[c][m] = _mm256_add_epi16(pairs[c][m], _mm256_add_epi16(_mm256_maddubs_epi16(lo, even[m]),
                                                                           _mm256_maddubs_epi16(hi, odd[m])));
          }
        }
        for (int c = 0; c < CG; ++c)
          for (int m = 0; m < MT; ++m) dot[c][m] = _mm256_madd_epi16(pairs[c][m], ones);
      }
      for (int c = 0; c < CG; ++c) {
        const __m256 ws = load8(scales + sc[c] + g * kRows);
        for (int m = 0; m < MT; ++m)
          acc[c][m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[c][m]), _mm256_mul_ps(ws, _mm256_set1_ps(xs[m][kb / kActBlock])), acc[c][m]);
      }
    }
    for (int c = 0; c < CG; ++c) {
      const __m256 ms = load8(mins + sc[c] + g * kRows);
      for (int m = 0; m < MT; ++m) acc[c][m] = _mm256_fmadd_ps(ms, _mm256_set1_ps(gs[m][g]), acc[c][m]);
    }
  }
  for (int c = 0; c < CG; ++c) {
    const int t = (c0 + c) / 2, half = (c0 + c) % 2;
    for (int m = 0; m < MT; ++m) _mm256_storeu_ps(out + (t * MT + m) * kRows + half * 8, acc[c][m]);
  }
}

// NT tiles = 2 * NT column groups, CG at a time: as many as keep the accumulators in registers.
template <int BITS, int MT, int NT, typename S>
void tile_dot(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
              const QuantizedActivations& a, int64_t m0, float* out) {
  constexpr int CG = std::min(2 * NT, std::max(1, 4 / MT));
  const ActivationRows<MT> rows(a, m0, Kp, G);
  for (int c0 = 0; c0 < 2 * NT; c0 += CG) {
    if (G == 16) column_groups<BITS, MT, CG, 16, S>(w, tile_bytes, scales, mins, Kp, G, rows, c0, out);
    else column_groups<BITS, MT, CG, kActBlock, S>(w, tile_bytes, scales, mins, Kp, G, rows, c0, out);
  }
}

#else  // portable form of the same arithmetic (no AVX-512 VNNI, no AVX2): slower, same results

template <int BITS, int MT, int NT, typename S>
void tile_dot(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
              const QuantizedActivations& a, int64_t m0, float* out) {
  constexpr int64_t kStep = BITS == 8 ? 4 : 8;
  const int64_t sub = std::min(G, kActBlock), groups = Kp / G;
  for (int t = 0; t < NT; ++t) {
    for (int m = 0; m < MT; ++m) {
      const int8_t* qx = a.q.data() + (m0 + m) * Kp;
      const float* xs = a.scale.data() + (m0 + m) * Kp / kActBlock;
      const float* gs = a.group_sum.data() + (m0 + m) * Kp / G;
      for (int64_t r = 0; r < kRows; ++r) {
        float acc = 0.f;
        for (int64_t g = 0; g < groups; ++g) {
          const float scale = scalar_of(scales + (t * groups + g) * kRows + r);
          const float min = scalar_of(mins + (t * groups + g) * kRows + r);
          for (int64_t kb = g * G; kb < (g + 1) * G; kb += sub) {
            int32_t dot = 0;
            for (int64_t k = kb; k < kb + sub; ++k) {
              const uint8_t byte = w[t * tile_bytes + (k / kStep) * 64 + r * 4 + k % 4];
              dot += (BITS == 8 ? byte : (k % 8 < 4 ? byte & 15 : byte >> 4)) * qx[k];
            }
            acc += static_cast<float>(dot) * (scale * xs[kb / kActBlock]);
          }
          acc += min * gs[g];
        }
        out[(t * MT + m) * kRows + r] = acc;
      }
    }
  }
}

#endif

// One pass over NT (1 or 2) tiles for MT (1-4) activation rows: the template arguments picked at run time.
template <int BITS, int NT, typename S>
void tile_rows(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
               const QuantizedActivations& a, int64_t m0, int64_t rows, float* out) {
  switch (rows) {
    case 1: return tile_dot<BITS, 1, NT, S>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
    case 2: return tile_dot<BITS, 2, NT, S>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
    case 3: return tile_dot<BITS, 3, NT, S>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
    default: return tile_dot<BITS, 4, NT, S>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
  }
}

template <int BITS, typename S>
void tiles_rows(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
                const QuantizedActivations& a, int64_t m0, int64_t rows, int64_t nt, float* out) {
  if (nt == 2) tile_rows<BITS, 2, S>(w, tile_bytes, scales, mins, Kp, G, a, m0, rows, out);
  else tile_rows<BITS, 1, S>(w, tile_bytes, scales, mins, Kp, G, a, m0, rows, out);
}

void check_packed(const torch::Tensor& qweight, const torch::Tensor& scales, const torch::Tensor& mins,
                  int64_t bits, int64_t group) {
  TORCH_CHECK(bits == 4 || bits == 8, "int_linear: 4- or 8-bit weights");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() && qweight.dim() == 4 &&
              qweight.size(2) == kRows && qweight.size(3) == 4, "int_linear: qweight [N/16, K*bits/32, 16, 4] uint8");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) &&
              mins.scalar_type() == scales.scalar_type() && scales.is_contiguous() && mins.is_contiguous() &&
              scales.sizes() == mins.sizes() && scales.size(0) == qweight.size(0) && scales.size(2) == kRows,
              "int_linear: scales and mins [N/16, K/group, 16] float32 or float16");
  const int64_t Kp = scales.size(1) * group;
  TORCH_CHECK((group == 16 || group % kActBlock == 0) && Kp % kActBlock == 0 &&
              qweight.size(1) * 32 == Kp * bits, "int_linear: group size and padded K do not match the weight");
}

}  // namespace

// y [M, n] = x [M, K] W^T (+ bias) for a packed integer W; x float32 / bfloat16 / float16.
torch::Tensor int_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, torch::Tensor mins,
                         int64_t bits, int64_t group, int64_t n, c10::optional<torch::Tensor> bias) {
  check_packed(qweight, scales, mins, bits, group);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "int_linear: contiguous x [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), Kp = scales.size(1) * group, tiles = qweight.size(0);
  TORCH_CHECK(K <= Kp && Kp - K < std::max(group, kActBlock) && n <= tiles * kRows && n > tiles * kRows - kRows,
              "int_linear: x has ", K, " inputs, the weight ", Kp, " (padded)");
  auto y = torch::empty({M, n}, x.options());
  torch::Tensor bias_f32;
  if (bias.has_value()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int_linear", [&] {
    const QuantizedActivations a = quantize_activations(x.data_ptr<scalar_t>(), M, K, Kp, group);
    scalar_t* yp = y.data_ptr<scalar_t>();
    const uint8_t* wp = qweight.data_ptr<uint8_t>();
    const int64_t tile_bytes = qweight.size(1) * kRows * 4, groups = Kp / group;
    // pairs of tiles: each weight byte unpacked once feeds up to 4 activation rows x 2 accumulators
    dispatch_scales(scales, [&](auto scale_type) {
      using S = std::remove_cv_t<std::remove_pointer_t<decltype(scale_type)>>;
      at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        float out[2 * kMaxTileRows * kRows];
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t t0 = 2 * pair, nt = std::min<int64_t>(2, tiles - t0);
          const S* sp = static_cast<const S*>(scales.data_ptr()) + t0 * groups * kRows;
          const S* mp = static_cast<const S*>(mins.data_ptr()) + t0 * groups * kRows;
          for (int64_t m0 = 0; m0 < M; m0 += kMaxTileRows) {
            const int64_t rows = std::min(kMaxTileRows, M - m0);
            if (bits == 8) tiles_rows<8, S>(wp + t0 * tile_bytes, tile_bytes, sp, mp, Kp, group, a, m0, rows, nt, out);
            else tiles_rows<4, S>(wp + t0 * tile_bytes, tile_bytes, sp, mp, Kp, group, a, m0, rows, nt, out);
            for (int64_t t = 0; t < nt; ++t) {
              const int64_t col0 = (t0 + t) * kRows, cols = std::min(kRows, n - col0);
              for (int64_t m = 0; m < rows; ++m)
                for (int64_t c = 0; c < cols; ++c)
                  heron::from_f32(yp + (m0 + m) * n + col0 + c,
                                  out[(t * rows + m) * kRows + c] + (bp ? bp[col0 + c] : 0.f));
            }
          }
        }
      });
    });
  });
  return y;
}
