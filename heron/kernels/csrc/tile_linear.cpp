// A bfloat16 matmul on AMX tiles whose rows do not depend on their batch: y = x W^T (+ bias), x [M, K] bfloat16,
// W in tiles (heron/quantization/base.py's ``tile_packed``: [N/16, K/32, 16 input pairs, 16 outputs x 2]
// bfloat16, N padded to 32 with zeros). Every output is one float32 sum over the inputs in order, 32 at a time
// by one tile multiply, whatever M, the row's place in it or the threads: a row's result is the same bits in any
// batch. oneDNN's GEMM picks its blocking (and so a row's last bits) by the number of rows, which heron's prompt
// rows cannot allow (heron/quantization/packed_int.py); this kernel takes them in one call instead of oneDNN
// calls of fixed size.
//
// A thread's item is a block of up to kBlockRows activation rows (kept in its L2 cache) times a run of weight
// tile pairs; per pair and 32 activation rows, four tile multiplies per 32 inputs into four float32 tiles.
// Without AMX but with AVX-512 BF16 (AMD Zen 4), the same layout feeds VDPBF16PS: one 64-byte step of a weight
// tile is one vector (16 outputs x one input pair), so each output is again one float32 sum over the input pairs
// in order, up to kVecRows rows x kVecTiles tiles at a time in registers (other bits than the tiles', the same
// bits for a row in any call).
#include "amx.h"
#include "float_rows.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HERON_AMX_BF16 1
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HERON_VECTOR_BF16 1
#endif

namespace {

constexpr int64_t kTileOut = 16;   // outputs per weight tile
constexpr int64_t kTileIn = 32;    // inputs per tile multiply (16 bfloat16 pairs)
constexpr int64_t kTileRows = 16;  // activation rows per tile
constexpr int64_t kBlockRows = 256;  // activation rows of one item
constexpr int64_t kCachedWeightBytes = 256 * 1024;  // weights multiplied by all of an item's rows in turn

#ifdef HERON_AMX_BF16
// Tile registers: 0, 1 activations [16 rows][32 inputs] of two row blocks; 2, 3 weights [16 input pairs][16
// outputs x 2] of two weight tiles; 4 + 2 b + t the float32 sums of row block b x weight tile t.
heron::TileConfig tile_config() {
  heron::TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kTileRows, c.colsb[t] = 64;
  return c;
}

// Rows [m0, m0 + 32) of x (``rows`` of them real: a copy padded with zero rows stands in for the last ones) times
// weight tiles 2j and 2j + 1, into ``sums`` [2 b + t][16][16].
void multiply_pair(const uint16_t* a, int64_t K, const uint16_t* w, int64_t j, float* sums) {
  const int64_t steps = K / kTileIn, tile = kTileIn * kTileOut;  // bfloat16s per weight tile
  const uint16_t* w0 = w + 2 * j * steps * tile;
  const uint16_t* w1 = w0 + steps * tile;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(0, a + s * kTileIn, K * 2);
    _tile_loadd(1, a + kTileRows * K + s * kTileIn, K * 2);
    _tile_loadd(2, w0 + s * tile, 64);
    _tile_loadd(3, w1 + s * tile, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    _tile_dpbf16ps(6, 1, 2);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, sums, 64);
  _tile_stored(5, sums + 256, 64);
  _tile_stored(6, sums + 512, 64);
  _tile_stored(7, sums + 768, 64);
}

// A tile of sums [16][16] (+ bias) as bfloat16 (rounded to nearest even) into y's rows [m0, m0 + rows), columns
// [col0, col0 + 16) below n.
void store_sums(const float* sums, int64_t rows, int64_t m0, int64_t col0, int64_t n, const float* bias,
                at::BFloat16* y) {
  const int64_t cols = std::min<int64_t>(kTileOut, n - col0);
  if (cols <= 0) return;
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < rows; ++m) {
    const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + m * kTileOut), b);
    _mm256_mask_storeu_epi16(y + (m0 + m) * n + col0, mask, (__m256i)_mm512_cvtneps_pbh(v));
  }
}

// The four tiles of sums of tile pair j for rows [m0, m0 + rows).
void store_pair(const float* sums, int64_t rows, int64_t m0, int64_t j, int64_t n, const float* bias,
                at::BFloat16* y) {
  for (int64_t b = 0; b < 2 && b * kTileRows < rows; ++b) {
    const int64_t block_rows = std::min(kTileRows, rows - b * kTileRows);
    for (int64_t t = 0; t < 2; ++t)
      store_sums(sums + (2 * b + t) * kTileRows * kTileOut, block_rows, m0 + b * kTileRows, (2 * j + t) * kTileOut, n,
                 bias, y);
  }
}
#endif

// How tile_linear splits its work: items of a block of rows x a run of weight tile pairs, enough of them to keep
// every thread busy; an item's rows take ``group`` pairs at a time, whose weights stay in the L2 cache meanwhile.
struct Schedule {
  int64_t pairs, blocks, runs, group;
  Schedule(int64_t M, int64_t K, int64_t tiles) : pairs(tiles / 2), blocks((M + kBlockRows - 1) / kBlockRows) {
    const int64_t threads = at::get_num_threads();
    runs = std::min(pairs, std::max<int64_t>(1, (2 * threads + blocks - 1) / blocks));
    group = std::max<int64_t>(1, kCachedWeightBytes / (2 * K * kTileOut * 2));
  }
  int64_t items() const { return blocks * runs; }
  // item's rows [m_begin, m_end) and tile pairs [j_begin, j_end)
  void bounds(int64_t item, int64_t M, int64_t& m_begin, int64_t& m_end, int64_t& j_begin, int64_t& j_end) const {
    const int64_t block = item / runs, run = item % runs;
    m_begin = block * kBlockRows, m_end = std::min(M, m_begin + kBlockRows);
    j_begin = pairs * run / runs, j_end = pairs * (run + 1) / runs;
  }
};

#ifdef HERON_VECTOR_BF16
constexpr int64_t kVecRows = 6;   // activation rows of one register block
constexpr int64_t kVecTiles = 4;  // weight tiles of one register block: MT x NT sums + NT weights in 32 registers

// Rows [m0, m0 + MT) of x times weight tiles [t0, t0 + NT) (+ bias) into y, as bfloat16: per input pair, one
// VDPBF16PS per row and tile (16 outputs), the row's pair broadcast. Each sum runs over the pairs in order.
template <int MT, int NT>
void vector_block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t t0, int64_t m0, int64_t n,
                  const float* bias, at::BFloat16* y) {
  const int64_t steps = K / 2;  // input pairs: a tile is ``steps`` vectors in a row
  __m512 acc[MT][NT];
  for (int m = 0; m < MT; ++m)
    for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_setzero_ps();
  const auto* xp = reinterpret_cast<const int32_t*>(x + m0 * K);
  const uint16_t* wt = w + t0 * steps * 2 * kTileOut;
  for (int64_t p = 0; p < steps; ++p) {
    __m512bh wv[NT];
    for (int t = 0; t < NT; ++t)
      wv[t] = (__m512bh)_mm512_loadu_si512(wt + (t * steps + p) * 2 * kTileOut);
    for (int m = 0; m < MT; ++m) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[m * steps + p]);
      for (int t = 0; t < NT; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xv, wv[t]);
    }
  }
  for (int t = 0; t < NT; ++t) {
    const int64_t col0 = (t0 + t) * kTileOut, cols = std::min<int64_t>(kTileOut, n - col0);
    if (cols <= 0) continue;
    const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col0) : _mm512_setzero_ps();
    for (int m = 0; m < MT; ++m)
      _mm256_mask_storeu_epi16(y + (m0 + m) * n + col0, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[m][t], b)));
  }
}

// vector_block with its row count picked at run time (the last rows of a block).
template <int NT>
void vector_rows(int64_t rows, const uint16_t* x, int64_t K, const uint16_t* w, int64_t t0, int64_t m0, int64_t n,
                 const float* bias, at::BFloat16* y) {
  switch (rows) {
    case 1: return vector_block<1, NT>(x, K, w, t0, m0, n, bias, y);
    case 2: return vector_block<2, NT>(x, K, w, t0, m0, n, bias, y);
    case 3: return vector_block<3, NT>(x, K, w, t0, m0, n, bias, y);
    case 4: return vector_block<4, NT>(x, K, w, t0, m0, n, bias, y);
    case 5: return vector_block<5, NT>(x, K, w, t0, m0, n, bias, y);
    default: return vector_block<kVecRows, NT>(x, K, w, t0, m0, n, bias, y);
  }
}

void vector_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t tiles, int64_t n,
                   const float* bias, at::BFloat16* y) {
  const Schedule plan(M, K, tiles);
  at::parallel_for(0, plan.items(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      int64_t m_begin, m_end, j_begin, j_end;
      plan.bounds(item, M, m_begin, m_end, j_begin, j_end);
      for (int64_t g0 = j_begin; g0 < j_end; g0 += plan.group) {
        const int64_t t_end = 2 * std::min(j_end, g0 + plan.group);
        for (int64_t m0 = m_begin; m0 < m_end; m0 += kVecRows) {
          const int64_t rows = std::min(kVecRows, m_end - m0);
          int64_t t = 2 * g0;
          for (; t + kVecTiles <= t_end; t += kVecTiles) vector_rows<kVecTiles>(rows, x, K, w, t, m0, n, bias, y);
          if (t < t_end) vector_rows<2>(rows, x, K, w, t, m0, n, bias, y);  // tiles come in pairs
        }
      }
    }
  });
}
#endif

}  // namespace

// Whether tile_linear multiplies on AMX tiles here: a CPU with AMX bfloat16 the kernel was compiled for, granted
// by Linux (and not turned off with HERON_AMX=0).
bool tile_linear_amx() {
#ifdef HERON_AMX_BF16
  return heron::amx_usable();
#else
  return false;
#endif
}

// Whether tile_linear runs here: on AMX tiles, or with AVX-512 BF16 vectors.
bool tile_linear_available() {
#ifdef HERON_VECTOR_BF16
  return true;
#else
  return tile_linear_amx();
#endif
}

// y [M, n] = x W^T (+ bias) for bfloat16 x [M, K] and W from tile_packed ([N/16, K/32, 16, 32], N >= n).
at::Tensor tile_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, int64_t n) {
  TORCH_CHECK(tile_linear_available(), "tile_linear: no AMX bfloat16 tiles or AVX-512 BF16 here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
              weight.dim() == 4 && weight.is_contiguous() && weight.size(2) == kTileIn / 2 &&
              weight.size(3) == 2 * kTileOut && weight.size(0) % 2 == 0,
              "tile_linear: bfloat16 x [M, K] and a weight from tile_packed");
  const int64_t M = x.size(0), K = weight.size(1) * kTileIn, tiles = weight.size(0);
  TORCH_CHECK(x.size(1) == K && n <= tiles * kTileOut, "tile_linear: x has ", x.size(1), " inputs, the weight ", K);
  auto y = at::empty({M, n}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  at::Tensor bias_f32;
  if (bias.has_value()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* yp = y.data_ptr<at::BFloat16>();
#ifdef HERON_VECTOR_BF16
  if (!tile_linear_amx()) {
    vector_linear(xp, M, K, wp, tiles, n, bp, yp);
    return y;
  }
#endif
#ifdef HERON_AMX_BF16
  const Schedule plan(M, K, tiles);
  at::parallel_for(0, plan.items(), 1, [&](int64_t begin, int64_t end) {
    const heron::TileScope tile_scope(tile_config());
    alignas(64) float sums[2][4 * kTileRows * kTileOut];  // one pair's while the next pair's are multiplied
    std::vector<uint16_t> tail(2 * kTileRows * K);
    // pair j's sums are rounded and stored while the tile unit multiplies the next pair's
    int64_t pending = -1, pending_rows = 0, pending_m0 = 0, buffer = 0;
    const auto multiply = [&](const uint16_t* a, int64_t rows, int64_t m0, int64_t j) {
      multiply_pair(a, K, wp, j, sums[buffer]);
      if (pending >= 0) store_pair(sums[1 - buffer], pending_rows, pending_m0, pending, n, bp, yp);
      pending = j, pending_rows = rows, pending_m0 = m0, buffer = 1 - buffer;
    };
    for (int64_t item = begin; item < end; ++item) {
      int64_t m_begin, m_end, j0, j1;
      plan.bounds(item, M, m_begin, m_end, j0, j1);
      // the block's rows against a few pairs at a time, whose weights stay in the L2 cache meanwhile
      for (int64_t g0 = j0; g0 < j1; g0 += plan.group) {
        for (int64_t m0 = m_begin; m0 < m_end; m0 += 2 * kTileRows) {
          const int64_t rows = std::min(2 * kTileRows, m_end - m0);
          const uint16_t* a = xp + m0 * K;
          if (rows < 2 * kTileRows) {  // the last rows: zero rows below them (rows never mix in a tile multiply)
            std::memcpy(tail.data(), a, rows * K * sizeof(uint16_t));
            std::fill(tail.begin() + rows * K, tail.end(), 0);
            a = tail.data();
          }
          for (int64_t j = g0; j < std::min(j1, g0 + plan.group); ++j) multiply(a, rows, m0, j);
        }
      }
    }
    if (pending >= 0) store_pair(sums[1 - buffer], pending_rows, pending_m0, pending, n, bp, yp);
  });
#endif
  return y;
}
