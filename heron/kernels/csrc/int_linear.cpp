// Integer-weight matmul: y = x W^T (+ bias) with W in heron's packed layout (heron/quantization/packed_int.py):
// w[n, k] = scale[n, g] * q[n, k] + min[n, g], q unsigned 4- or 8-bit, tiles of 16 output rows whose lanes hold
// 4 consecutive inputs. Activations are quantized to int8 per 32 inputs (as llama.cpp's q8 blocks), so
//   sum_k w x ~= sum_g scale_g * sum_b dx_b * sum_{k in b} q_k qx_k + min_g * sum_{k in g} dx qx
// and the inner sum is one AVX-512 VNNI instruction per 16 rows x 4 inputs (u8 weights x s8 activations), or
// two AVX2 instructions per 8 rows x 4 inputs where there is no VNNI. With AMX, 16 activation rows at a time take
// one tile multiply per 16 outputs x 32 inputs instead (the same integer sums, the same float32 steps: equal bits).
#include "amx.h"
#include "float_rows.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdlib>
#include <string>
#include <vector>

namespace {

constexpr int64_t kRows = 16;      // output rows per tile
constexpr int64_t kActBlock = 32;  // inputs per activation scale
constexpr int64_t kMaxTileRows = 4;  // activation rows sharing one pass over a tile's weights
// A call of up to kOneTileMaxRows rows (decode steps of a few sequences) takes all its rows in one pass and reads a
// pair's two tiles one after the other, not side by side: one stream of weights per thread, which its prefetch
// keeps far enough ahead to read at memory speed (Zen 4, a model's layers from memory, 4-bit weights: one row
// 1.45x, four 1.22x, 5-8 rows 1.0-1.2x; 8-bit: 1.14-1.28x; docs/performance.md). Calls of more rows keep pairs of
// tiles and passes of kMaxTileRows: compute-bound there, they lose with 8-row passes (0.73-0.83x), and one tile
// at a time is within noise. Measured with the VNNI loop only.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr bool kOneTilePasses = true;
#else
constexpr bool kOneTilePasses = false;
#endif
constexpr int64_t kOneTileMaxRows = 8;

}  // namespace

// Whether int_linear_row_scale runs here (its epilogue is written for the AVX-512 VNNI loop only).
bool row_scale_available() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

namespace {

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
void dispatch_scales(const at::Tensor& scales, F body) {
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

// 32 inputs to int8 with the scale max|v| / 127 (rounded to nearest even), and the sums of each 16 int8 values.
inline void quantize_block(const float* v, int8_t* q, float* scale, int32_t* sum16) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i r0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), r1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(r0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(r1));
  sum16[0] = _mm512_reduce_add_epi32(r0), sum16[1] = _mm512_reduce_add_epi32(r1);
#else
  float amax = 0.f;
  for (int64_t i = 0; i < kActBlock; ++i) amax = std::max(amax, std::abs(v[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  sum16[0] = sum16[1] = 0;
  for (int64_t i = 0; i < kActBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(v[i] * inv));
    sum16[i / 16] += q[i];
  }
#endif
  *scale = amax / 127.f;
}

// The sum of a row's int8 values over inputs [k, k + count), count 16 or 32, from its sums per 16 inputs.
inline int32_t int_sum(const int32_t* sum16, int64_t k, int64_t count) {
  return count == 16 ? sum16[k / 16] : sum16[k / 16] + sum16[k / 16 + 1];
}

// Rows M .. rows - 1 (padding for a pass of whole row blocks) are zeros.
template <typename T>
QuantizedActivations quantize_activations(const T* x, int64_t M, int64_t rows, int64_t K, int64_t Kp, int64_t G) {
  QuantizedActivations a{std::vector<int8_t>(rows * Kp), std::vector<float>(rows * Kp / kActBlock),
                         std::vector<float>(rows * Kp / G), std::vector<int32_t>(rows * Kp / 16)};
  at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(Kp, 0.f);  // inputs K .. Kp - 1 stay zero
    for (int64_t m = begin; m < end; ++m) {
      heron::load_row(x + m * K, row.data(), K);
      int8_t* q = a.q.data() + m * Kp;
      float* scale = a.scale.data() + m * Kp / kActBlock;
      int32_t* sum16 = a.sum16.data() + m * Kp / 16;
      for (int64_t b = 0; b < Kp / kActBlock; ++b) quantize_block(row.data() + b * kActBlock, q + b * kActBlock, scale + b, sum16 + 2 * b);
      // the min term's, from the same rounded values: each block's scale times its exact integer sum
      float* group_sum = a.group_sum.data() + m * Kp / G;
      const int64_t sub = std::min(G, kActBlock);
      for (int64_t g = 0; g < Kp / G; ++g) {
        float total = 0.f;
        for (int64_t k = g * G; k < (g + 1) * G; k += sub) total += scale[k / kActBlock] * int_sum(sum16, k, sub);
        group_sum[g] = total;
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
  int32_t sum_of(int m, int64_t k, int64_t count) const { return int_sum(sum16[m], k, count); }
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

// Bytes ahead of each tile's stream to prefetch: a layer's matrix is short (0.2-1 MB per thread), too short for
// the hardware prefetcher to reach full speed (on Zen 3's AVX2 loop a model pass
// 5-10% faster, the 8-bit LM head ~10%; on Zen 4's VNNI loop see docs/performance.md). A tile read alone (see
// kOneTilePasses) is its thread's only stream and is fetched further ahead.
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kOneStreamPrefetchBytes = 4096;

// Starts fetching the cache line ``bytes`` ahead of ``p``.
template <int64_t bytes = kPrefetchBytes>
inline void prefetch_ahead(const uint8_t* p) {
  _mm_prefetch(reinterpret_cast<const char*>(p + bytes), _MM_HINT_T0);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

inline __m512i broadcast4(const int8_t* p) { return _mm512_set1_epi32(four_bytes(p)); }

// One block of ``SUB`` inputs (a scale's span: 16 or 32) of NT tiles x MT activation rows: int8 dot products into
// int32 accumulators (the 64-byte steps unrolled), then scaled into the float32 sums ``acc``. One or two rows keep
// two chains per (tile, row), even and odd steps, to hide VPDPBUSD's latency; from three rows there are chains
// enough and one each leaves registers for more rows. Integer sums are exact: the split does not change a bit.
// ROW (a weight of one scale per output row, see int_linear_row_scale): the sums are scaled by the activations'
// scale only, the row's weight scale is applied once by tile_dot.
template <int BITS, int MT, int NT, int64_t SUB, typename S, bool ROW = false>
inline void block_dot(const uint8_t* const* wp, const S* const* ws_p, const ActivationRows<MT>& rows, int64_t kb,
                      __m512 (&acc)[NT][MT]) {
  constexpr int kChains = MT <= 2 ? 2 : 1;
  constexpr int64_t kStep = BITS == 8 ? 4 : 8;  // inputs per 64-byte step
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  __m512i dot[kChains][NT][MT];
  for (int c = 0; c < kChains; ++c)
    for (int t = 0; t < NT; ++t)
      for (int m = 0; m < MT; ++m) dot[c][t][m] = _mm512_setzero_si512();
  for (int64_t s = 0; s < SUB / kStep; ++s) {
    const int64_t k = kb + s * kStep;
    for (int t = 0; t < NT; ++t) {
      const uint8_t* w = wp[t] + s * 64;
      prefetch_ahead<NT == 1 ? kOneStreamPrefetchBytes : kPrefetchBytes>(w);
      const __m512i v = _mm512_loadu_si512(w);
      // 8-bit: the step's 4 inputs per row; 4-bit: inputs 0-3 in the low nibbles, 4-7 in the high ones
      const __m512i first = BITS == 8 ? v : _mm512_and_si512(v, low4);
      for (int m = 0; m < MT; ++m) {
        __m512i& d = dot[BITS == 8 ? s % kChains : 0][t][m];
        d = _mm512_dpbusd_epi32(d, first, broadcast4(rows.q[m] + k));
      }
      if constexpr (BITS == 4) {
        const __m512i second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int m = 0; m < MT; ++m) {
          __m512i& d = dot[kChains - 1][t][m];
          d = _mm512_dpbusd_epi32(d, second, broadcast4(rows.q[m] + k + 4));
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    const __m512 ws = ROW ? _mm512_setzero_ps() : load16(ws_p[t]);
    for (int m = 0; m < MT; ++m) {
      const __m512 scale = ROW ? _mm512_set1_ps(rows.scale[m][kb / kActBlock])
                               : _mm512_mul_ps(ws, _mm512_set1_ps(rows.scale[m][kb / kActBlock]));
      const __m512i sum = kChains == 2 ? _mm512_add_epi32(dot[0][t][m], dot[kChains - 1][t][m]) : dot[0][t][m];
      acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[t][m]);
    }
  }
}

// out[t][m][16] = the 16 rows of NT consecutive tiles times MT activation rows, block by block, each group's min
// term added at its end (ROW: the one group's weight scale too, see block_dot).
template <int BITS, int MT, int NT, typename S, bool ROW = false>
void tile_dot(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
              const QuantizedActivations& a, int64_t m0, float* out) {
  constexpr int64_t kStep = BITS == 8 ? 4 : 8;
  const int64_t sub = std::min(G, kActBlock), groups = Kp / G;
  const ActivationRows<MT> rows(a, m0, Kp, G);
  __m512 acc[NT][MT];
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) acc[t][m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t kb = g * G; kb < (g + 1) * G; kb += sub) {
      const uint8_t* wp[NT];
      const S* ws_p[NT];
      for (int t = 0; t < NT; ++t) wp[t] = w + t * tile_bytes + kb / kStep * 64, ws_p[t] = scales + (t * groups + g) * kRows;
      if (sub == 16) block_dot<BITS, MT, NT, 16, S, ROW>(wp, ws_p, rows, kb, acc);
      else block_dot<BITS, MT, NT, kActBlock, S, ROW>(wp, ws_p, rows, kb, acc);
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 ms = load16(mins + (t * groups + g) * kRows);
      for (int m = 0; m < MT; ++m) {
        if constexpr (ROW) {
          acc[t][m] = _mm512_fmadd_ps(acc[t][m], load16(scales + (t * groups + g) * kRows),
                                      _mm512_mul_ps(ms, _mm512_set1_ps(rows.group_sum[m][g])));
        } else {
          acc[t][m] = _mm512_fmadd_ps(ms, _mm512_set1_ps(rows.group_sum[m][g]), acc[t][m]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int m = 0; m < MT; ++m) _mm512_storeu_ps(out + (t * MT + m) * kRows, acc[t][m]);
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

inline __m256i broadcast4(const int8_t* p) { return _mm256_set1_epi32(four_bytes(p)); }

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
template <int BITS, int MT, int NT, typename S, bool ROW = false>
void tile_dot(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
              const QuantizedActivations& a, int64_t m0, float* out) {
  static_assert(!ROW, "one scale per output row: the AVX-512 VNNI loop only");
  constexpr int CG = std::min(2 * NT, std::max(1, 4 / MT));
  const ActivationRows<MT> rows(a, m0, Kp, G);
  for (int c0 = 0; c0 < 2 * NT; c0 += CG) {
    if (G == 16) column_groups<BITS, MT, CG, 16, S>(w, tile_bytes, scales, mins, Kp, G, rows, c0, out);
    else column_groups<BITS, MT, CG, kActBlock, S>(w, tile_bytes, scales, mins, Kp, G, rows, c0, out);
  }
}

#else  // portable form of the same arithmetic (no AVX-512 VNNI, no AVX2): slower, same results

template <int BITS, int MT, int NT, typename S, bool ROW = false>
void tile_dot(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
              const QuantizedActivations& a, int64_t m0, float* out) {
  static_assert(!ROW, "one scale per output row: the AVX-512 VNNI loop only");
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

constexpr int64_t kAmxRows = 16;  // activation rows per tile multiply (int_linear pads them to it where it tiles)

#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HERON_AMX_INT8 1

constexpr int64_t kAmxMinRows = 12;  // fewer rows: the VNNI loop (a tile multiply costs the same for 1 row as 16)
constexpr int64_t kTileInts = kAmxRows * kRows;  // one int32 result tile

// Tile registers: 0, 1 activations [16 rows][sub int8] of two row blocks; 2, 3 weights [sub/4][16 outputs x 4
// inputs] of two packed tiles (the layout's 64-byte steps, 4-bit ones unpacked); 4 + 2 t + b the int32 sums of
// packed tile t x row block b.
heron::TileConfig tile_config(int64_t sub) {
  heron::TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = t >= 2 && t < 4 ? static_cast<uint8_t>(sub / 4) : kAmxRows;
    c.colsb[t] = t < 2 ? static_cast<uint16_t>(sub) : 64;
  }
  return c;
}

// A tile's weights as one byte per input in the tile layout of 8-bit weights (4-bit steps of 8 inputs -> 2 steps).
void unpack_tile4(const uint8_t* w, int64_t Kp, uint8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int64_t s = 0; s < Kp / 8; ++s) {
    const __m512i v = _mm512_loadu_si512(w + s * 64);
    _mm512_storeu_si512(out + 2 * s * 64, _mm512_and_si512(v, low4));
    _mm512_storeu_si512(out + (2 * s + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), low4));
  }
}

// Sums of packed tile t x row block b into register C = 4 + 2t + b (from A = b, B = 2 + t); amx_tiles stores them
// to memory later (a _tile_stored waits for its multiply). GCC's tile intrinsics paste the register numbers into
// the instruction text: literal numbers only.
#define HERON_TILE_MULTIPLY(C, A, B) \
  _tile_zero(C);                     \
  _tile_dpbsud(C, A, B)

// NT (1-2) packed tiles x NB (1-2) blocks of 16 activation rows from m0 (rows past M are zeros): acc [2 t + b]
// [16 rows][16 outputs] float32. Each block of ``sub`` inputs is one tile multiply per pair (signed activations x
// unsigned weights, 8-bit layout ``w[t]``) whose sums the float32 steps of tile_dot take in its order (the block's
// scale, then at a group's end its min term), so every row gets tile_dot's bits. The float steps of a block run
// while the tile unit multiplies the next one, whose sums are stored only after them (sums double-buffered: a
// store right after its multiply held the float steps back until the multiply was done).
template <int NT, int NB, typename S>
void amx_tiles(const uint8_t* const* w, const S* const* scales, const S* const* mins, int64_t Kp, int64_t G,
               const QuantizedActivations& a, int64_t m0, int32_t* sums, float* acc) {
  const int64_t sub = std::min(G, kActBlock), blocks = Kp / sub;
  int32_t* next = sums;
  int32_t* done = sums + 4 * kTileInts;
  for (int i = 0; i < NT * NB * kTileInts; i += 16) _mm512_store_ps(acc + i, _mm512_setzero_ps());
  for (int64_t blk = 0; blk <= blocks; ++blk) {
    if (blk < blocks) {
      const int64_t k = blk * sub;
      _tile_loadd(0, a.q.data() + m0 * Kp + k, Kp);
      if constexpr (NB == 2) _tile_loadd(1, a.q.data() + (m0 + kAmxRows) * Kp + k, Kp);
      _tile_loadd(2, w[0] + k * 16, 64);
      if constexpr (NT == 2) _tile_loadd(3, w[1] + k * 16, 64);
      HERON_TILE_MULTIPLY(4, 0, 2);
      if constexpr (NB == 2) { HERON_TILE_MULTIPLY(5, 1, 2); }
      if constexpr (NT == 2) { HERON_TILE_MULTIPLY(6, 0, 3); }
      if constexpr (NT == 2 && NB == 2) { HERON_TILE_MULTIPLY(7, 1, 3); }
    }
    if (blk > 0) {
      const int64_t k = (blk - 1) * sub, g = k / G;
      const bool group_end = (k + sub) % G == 0;
      for (int t = 0; t < NT; ++t) {
        const __m512 ws = load16(scales[t] + g * kRows);
        const __m512 ms = load16(mins[t] + g * kRows);
        for (int b = 0; b < NB; ++b) {
          const int32_t* dot = done + (2 * t + b) * kTileInts;
          float* out = acc + (t * NB + b) * kTileInts;
          const float* xs = a.scale.data() + (m0 + b * kAmxRows) * (Kp / kActBlock) + k / kActBlock;
          const float* gs = a.group_sum.data() + (m0 + b * kAmxRows) * (Kp / G) + g;
          for (int m = 0; m < kAmxRows; ++m) {
            const __m512 s = _mm512_mul_ps(ws, _mm512_set1_ps(xs[m * (Kp / kActBlock)]));
            __m512 r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dot + m * kRows)), s,
                                       _mm512_load_ps(out + m * kRows));
            if (group_end) r = _mm512_fmadd_ps(ms, _mm512_set1_ps(gs[m * (Kp / G)]), r);
            _mm512_store_ps(out + m * kRows, r);
          }
        }
      }
    }
    if (blk < blocks) {
      _tile_stored(4, next, 64);
      if constexpr (NB == 2) _tile_stored(5, next + kTileInts, 64);
      if constexpr (NT == 2) _tile_stored(6, next + 2 * kTileInts, 64);
      if constexpr (NT == 2 && NB == 2) _tile_stored(7, next + 3 * kTileInts, 64);
    }
    std::swap(next, done);
  }
}

#endif

// One pass over NT (1 or 2) tiles for MT (1-4; 5-8 with one tile) activation rows: the template arguments picked at
// run time.
template <int BITS, int NT, typename S, bool ROW>
void tile_rows(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
               const QuantizedActivations& a, int64_t m0, int64_t rows, float* out) {
  if constexpr (NT == 1 && kOneTilePasses) {  // a call of 5-8 rows in one pass
    switch (rows) {
      case 5: return tile_dot<BITS, 5, 1, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
      case 6: return tile_dot<BITS, 6, 1, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
      case 7: return tile_dot<BITS, 7, 1, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
      case 8: return tile_dot<BITS, 8, 1, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
      default: break;
    }
  }
  switch (rows) {
    case 1: return tile_dot<BITS, 1, NT, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
    case 2: return tile_dot<BITS, 2, NT, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
    case 3: return tile_dot<BITS, 3, NT, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
    default: return tile_dot<BITS, 4, NT, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, out);
  }
}

template <int BITS, typename S, bool ROW = false>
void tiles_rows(const uint8_t* w, int64_t tile_bytes, const S* scales, const S* mins, int64_t Kp, int64_t G,
                const QuantizedActivations& a, int64_t m0, int64_t rows, int64_t nt, float* out) {
  if (nt == 2) tile_rows<BITS, 2, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, rows, out);
  else tile_rows<BITS, 1, S, ROW>(w, tile_bytes, scales, mins, Kp, G, a, m0, rows, out);
}

// Rows m0 .. m0 + rows - 1 of one tile's 16 outputs (out [rows][16], float32) into y [M, n], plus the bias.
template <typename T>
void store_tile(const float* out, int64_t rows, int64_t m0, int64_t col0, int64_t n, const float* bias, T* y) {
  const int64_t cols = std::min(kRows, n - col0);
  float row[kRows];
  for (int64_t m = 0; m < rows; ++m) {
#pragma omp simd
    for (int64_t c = 0; c < cols; ++c) row[c] = out[m * kRows + c] + (bias ? bias[col0 + c] : 0.f);
    heron::store_row(row, y + (m0 + m) * n + col0, cols);
  }
}

void check_packed(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins,
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

// y [M, n] = x [M, K] W^T (+ bias) for a packed integer W; x float32 / bfloat16 / float16. row: W is 8-bit with
// one group per output row, its scale applied once (int_linear_row_scale).
at::Tensor packed_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                         int64_t bits, int64_t group, int64_t n, c10::optional<at::Tensor> bias, bool row) {
  check_packed(qweight, scales, mins, bits, group);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "int_linear: contiguous x [M, K] on the CPU");
  const int64_t M = x.size(0), K = x.size(1), Kp = scales.size(1) * group, tiles = qweight.size(0);
  TORCH_CHECK(K <= Kp && Kp - K < std::max(group, kActBlock) && n <= tiles * kRows && n > tiles * kRows - kRows,
              "int_linear: x has ", K, " inputs, the weight ", Kp, " (padded)");
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;  // (a pass of zero rows would divide by zero)
  at::Tensor bias_f32;
  if (bias.has_value()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
#ifdef HERON_AMX_INT8
  const bool amx = !row && M >= kAmxMinRows && heron::amx_usable();
#else
  const bool amx = false;
#endif
  HERON_DISPATCH_MODEL_TYPES(x.scalar_type(), "int_linear", [&] {
    const int64_t padded_rows = amx ? (M + kAmxRows - 1) / kAmxRows * kAmxRows : M;
    const QuantizedActivations a = quantize_activations(x.data_ptr<scalar_t>(), M, padded_rows, K, Kp, group);
    scalar_t* yp = y.data_ptr<scalar_t>();
    const uint8_t* wp = qweight.data_ptr<uint8_t>();
    const int64_t tile_bytes = qweight.size(1) * kRows * 4, groups = Kp / group;
    dispatch_scales(scales, [&](auto scale_type) {
      using S = std::remove_cv_t<std::remove_pointer_t<decltype(scale_type)>>;
      const S* scales_p = static_cast<const S*>(scales.data_ptr());
      const S* mins_p = static_cast<const S*>(mins.data_ptr());
#ifdef HERON_AMX_INT8
      if (amx) {  // pairs of tiles x pairs of row blocks, the weights unpacked once for all row blocks
        at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
          const heron::TileScope tile_scope(tile_config(std::min(group, kActBlock)));
          std::vector<uint8_t> unpacked(bits == 4 ? 2 * Kp * kRows : 0);
          alignas(64) int32_t sums[2 * 4 * kTileInts];
          alignas(64) float acc[4 * kTileInts];
          for (int64_t pair = begin; pair < end; ++pair) {
            const int64_t t0 = 2 * pair, nt = std::min<int64_t>(2, tiles - t0);
            const uint8_t* w[2];
            const S *sp[2], *mp[2];
            for (int64_t t = 0; t < nt; ++t) {
              w[t] = wp + (t0 + t) * tile_bytes;
              if (bits == 4) unpack_tile4(w[t], Kp, unpacked.data() + t * Kp * kRows), w[t] = unpacked.data() + t * Kp * kRows;
              sp[t] = scales_p + (t0 + t) * groups * kRows, mp[t] = mins_p + (t0 + t) * groups * kRows;
            }
            for (int64_t m0 = 0; m0 < M; m0 += 2 * kAmxRows) {
              const int64_t nb = M - m0 > kAmxRows ? 2 : 1;
              if (nt == 2 && nb == 2) amx_tiles<2, 2, S>(w, sp, mp, Kp, group, a, m0, sums, acc);
              else if (nt == 2) amx_tiles<2, 1, S>(w, sp, mp, Kp, group, a, m0, sums, acc);
              else if (nb == 2) amx_tiles<1, 2, S>(w, sp, mp, Kp, group, a, m0, sums, acc);
              else amx_tiles<1, 1, S>(w, sp, mp, Kp, group, a, m0, sums, acc);
              for (int64_t t = 0; t < nt; ++t)
                for (int64_t b = 0; b < nb; ++b)
                  store_tile(acc + (t * nb + b) * kTileInts, std::clamp<int64_t>(M - m0 - b * kAmxRows, 0, kAmxRows),
                             m0 + b * kAmxRows, (t0 + t) * kRows, n, bp, yp);
            }
          }
        });
        return;
      }
#endif
      // pairs of tiles: each weight byte unpacked once feeds up to 4 activation rows x 2 accumulators (or, in a
      // call of a few rows, all of them x 1: see kOneTilePasses)
      const bool one_tile = kOneTilePasses && M <= kOneTileMaxRows;
      const int64_t pass_rows = one_tile ? M : kMaxTileRows, passes = (M + pass_rows - 1) / pass_rows;
      at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
        float out[2 * kOneTileMaxRows * kRows];
        for (int64_t pair = begin; pair < end; ++pair) {
          const int64_t t0 = 2 * pair, nt = std::min<int64_t>(2, tiles - t0);
          const S* sp = scales_p + t0 * groups * kRows;
          const S* mp = mins_p + t0 * groups * kRows;
          // Several passes (more than kOneTileMaxRows rows): each also starts fetching its share of the next pair's
          // weights into L2, the first one the next pair's scales and mins, so that pair's first pass finds them
          // there instead of waiting on memory (decode steps of 9-32 sequences: the layers 1.06-1.14x,
          // docs/performance.md). Written out here: GCC drops a call to a function that only prefetches.
          const int64_t next_tiles = passes > 1 && pair + 1 < end ? std::min<int64_t>(2, tiles - t0 - 2) : 0;
          const int64_t next_bytes = next_tiles * tile_bytes, share = (next_bytes / passes + 63) / 64 * 64;
          const int64_t next_scale_bytes = next_tiles * groups * kRows * sizeof(S);
          const uint8_t* next = wp + (t0 + 2) * tile_bytes;
          for (int64_t m0 = 0, pass = 0; m0 < M; m0 += pass_rows, ++pass) {
            for (int64_t off = pass * share; off < std::min(next_bytes, (pass + 1) * share); off += 64)
              _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T1);
            for (int64_t off = 0; pass == 0 && off < next_scale_bytes; off += 64) {
              _mm_prefetch(reinterpret_cast<const char*>(sp + 2 * groups * kRows) + off, _MM_HINT_T1);
              _mm_prefetch(reinterpret_cast<const char*>(mp + 2 * groups * kRows) + off, _MM_HINT_T1);
            }
            const int64_t rows = std::min(pass_rows, M - m0);
            const int64_t step = one_tile ? 1 : nt;  // tiles per call
            for (int64_t t = 0; t < nt; t += step) {
              const int64_t at = (t0 + t) * tile_bytes, scale_at = t * groups * kRows;
              float* o = out + t * rows * kRows;
              if (row) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)  // int_linear_row_scale checks
                tiles_rows<8, S, true>(wp + at, tile_bytes, sp + scale_at, mp + scale_at, Kp, group, a, m0, rows, step, o);
#endif
              } else if (bits == 8) tiles_rows<8, S>(wp + at, tile_bytes, sp + scale_at, mp + scale_at, Kp, group, a, m0, rows, step, o);
              else tiles_rows<4, S>(wp + at, tile_bytes, sp + scale_at, mp + scale_at, Kp, group, a, m0, rows, step, o);
            }
            for (int64_t t = 0; t < nt; ++t) store_tile(out + t * rows * kRows, rows, m0, (t0 + t) * kRows, n, bp, yp);
          }
        }
      });
    });
  });
  return y;
}

at::Tensor int_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                      int64_t bits, int64_t group, int64_t n, c10::optional<at::Tensor> bias) {
  return packed_linear(std::move(x), std::move(qweight), std::move(scales), std::move(mins), bits, group, n,
                       std::move(bias), false);
}

// y = x W^T (+ bias) for an 8-bit packed W with one scale and min per output row (a single group): each 32-input
// block's integer sums scaled by the activations' scale, the row's weight scale and min term applied once at the
// end, so the epilogue per block is a convert and one FMA instead of also a product of scales (and the min's FMA):
// ~1.15-1.2x the multiply-adds per second of the 4-bit layout at many rows on Zen 4 (docs/performance.md). AVX-512
// VNNI only (row_scale_available); every row count takes the same arithmetic, so a row's result does not depend on
// its batch.
at::Tensor int_linear_row_scale(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                                int64_t n, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(row_scale_available(), "int_linear_row_scale needs AVX-512 VNNI");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == 1, "int_linear_row_scale: one scale per output row");
  const int64_t Kp = qweight.size(1) * 4;
  return packed_linear(std::move(x), std::move(qweight), std::move(scales), std::move(mins), 8, Kp, n,
                       std::move(bias), true);
}

// The row count from which int_linear takes AMX tiles here, 0 where it never does (no AMX, or HERON_AMX=0).
int64_t int_linear_amx_rows() {
#ifdef HERON_AMX_INT8
  return heron::amx_usable() ? kAmxMinRows : 0;
#else
  return 0;
#endif
}
