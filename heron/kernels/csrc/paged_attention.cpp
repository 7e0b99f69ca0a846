// Paged attention for the CPU: queries read their sequence's keys and values in place through the block table
// (no gather into a new tensor), with an online softmax in float32. Covers any number of queries per sequence
// (decode, speculative verification, prefill chunks over a cached prefix), GQA and sliding windows.
//
// A unit of work is one sequence's queries (up to kUnitQueries of them) under one KV head. Its rows are the
// (query, query head of the group) pairs, in position order; it walks the context once, kTile positions at a
// time, each tile's keys and values read and converted to float32 once for all of its rows, and every row keeps
// its own online-softmax state (running max, denominator, accumulator) over the positions it attends: query i
// of a sequence's n sits at position seq_len - n + i and attends positions <= its own (causal among the new
// tokens too), from pos - window + 1 on under a sliding window.
// The pool is head-major, [2, NB, KVH, BS, D]: a block's positions of one KV head lie together, so a tile of 16
// positions is one run of 2 KB of keys and one of values (bfloat16, head dim 64) instead of 128 bytes of each
// position's 384-byte row of all heads: decode of 32 sequences from memory 1.28-1.35x faster on Zen 4.
// A tile's scores are a small matrix product, vectorized over the rows of a row-vector (a key's element broadcast
// against 4, 8 or 16 queries: no horizontal sums, eight keys' sums in registers). With bfloat16 queries and pool
// on AVX-512 BF16 a key's elements are broadcast in pairs straight from the pool into VDPBF16PS (pair_scores):
// half the instructions, no conversion of the keys (decode of 32 sequences x 192 positions: 1.27x on Zen 4); a
// float8 pool's keys are converted to bfloat16 (exactly) a tile at a time and take the same path.
//
// Batch invariance: a row's output is the same, bit for bit, whatever else the step holds (one query of a decode,
// one of a verification step's, beside other sequences) and whatever the thread count, which speculative
// decoding's identical greedy output rests on. So every row's arithmetic depends on its own position only:
// - each (row, key) score is one sum over the head dim in order, whatever the row-vector's width (lanes are
//   independent);
// - tiles start at multiples of kTile, and a tile that holds none of a row's positions leaves its state
//   untouched (its correction is exactly 1 where the max stays, its sum exactly 0);
// - the context is cut into chunks at multiples of kChunk positions, each with its own state, and a row's chunk
//   states are merged one by one in position order by one function (merge_state), whether one thread takes a
//   unit's chunks in turn or, where the units are few for the threads (a single sequence's decode or
//   verification step), several threads take them (flash-decoding) and the unit's last one merges; threads take
//   the work items dynamically, which decides only who computes what.
// Head dims 64 and 128 are compiled in; the next tile's rows are prefetched while a tile is computed.
// The pool holds the queries' dtype, or float8 (an fp8 KV cache): stored keys are k / k_scale and values
// v / v_scale, so k_scale is folded into the scaled query and v_scale into the output's normalization.
#include <ATen/Parallel.h>

#include "float_rows.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HERON_BF16_PAIRS 1
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace heron;

constexpr int64_t kTile = 16;         // context positions per tile (tiles start at multiples of kTile)
constexpr int64_t kLanes = 16;        // rows of a row-vector
// floats in one of the target's vector registers: a wider generic vector is split by GCC through the stack
#if defined(__AVX512F__)
constexpr int64_t kVector = 16;
#else
constexpr int64_t kVector = 8;
#endif
constexpr int64_t kChunk = 4 * kTile;  // context positions per chunk (chunks start at multiples of kChunk)
constexpr int64_t kUnitQueries = 16;  // a sequence's queries in one unit (more: several units)
constexpr int64_t kPartsPerThread = 2;  // a split context: about this many items per thread, to even them out
constexpr float kNoMax = -std::numeric_limits<float>::max();  // running max before any position: e^(kNoMax - m) = 0

struct Unit {
  int64_t b, kvh;              // sequence, KV head
  int64_t q0, q1;              // its queries: rows [q0, q1) of q
  int64_t num_q, seq_len;      // the sequence's: query i of num_q sits at position seq_len - num_q + i
  int64_t key_begin, key_end;  // the positions its queries attend, together
  int64_t chunk0, chunk1;      // the chunks they lie in: [chunk0, chunk1)
  int64_t parts;               // > 1: its chunks spread over several items, their states merged at the end
  int64_t partial;             // where its chunks' states start in the partial buffer
};

struct Item {  // what one thread takes at a time: a unit's chunks [chunk0, chunk1)
  int64_t unit, chunk0, chunk1;
};

// One thread's float32 working memory (qf: the rows' scaled queries, [rows][D]; qt: transposed per row-vector,
// [vectors][D][kLanes]; keys, values: a tile's, [kTile][D]; scores: [kTile][kLanes]; max, denom, acc: the rows'
// state over the current chunk; merged_*: over the chunks so far).
struct Scratch {
  std::vector<float> keys, values, qf, qt, acc, max, denom, scores, row, merged_max, merged_denom, merged_acc;
  std::vector<uint32_t> qp;  // bfloat16 pairs: the rows' queries, [vectors][D / 2][kLanes] (pair_scores)
  std::vector<uint16_t> key_bits;  // a float8 tile's keys in bfloat16, [kTile][D] (pair_scores)
  std::vector<int32_t> pos, first;
};

// W floats, for the loops whose sums must stay in registers: GCC and Clang's vector extension (lowered to whatever
// vector width the target has). Other compilers get a plain array.
#if defined(__GNUC__)
template <int64_t W>
struct LanesOf {
  typedef float type __attribute__((vector_size(W * sizeof(float))));
};
#else
template <int64_t W>
struct LanesOf {
  struct type {
    float v[W] = {};
    type& operator+=(const type& o) {
      for (int64_t i = 0; i < W; ++i) v[i] += o.v[i];
      return *this;
    }
    friend type operator*(type a, float s) {
      for (int64_t i = 0; i < W; ++i) a.v[i] *= s;
      return a;
    }
  };
};
#endif
template <int64_t W>
inline typename LanesOf<W>::type load_lanes(const float* p) {
  typename LanesOf<W>::type x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}
template <int64_t W>
inline void store_lanes(float* p, const typename LanesOf<W>::type& x) { std::memcpy(p, &x, sizeof(x)); }

// A tile's scores for the first W rows of a row-vector: s[r * kLanes + l] = q_l . key_r, vectorized over W rows,
// eight keys at a time (eight independent sums). qt: the rows' queries, transposed ([D][kLanes]); keys: kTile
// rows of D, key_stride apart.
// Every (row, key) score is the same sum whatever W (lanes are independent, each summed over d = 0, 1, ... in
// order): a row's score does not depend on how many rows share its row-vector. W only trims the padding work.
template <int64_t DC, int64_t W>
inline void tile_scores(const float* __restrict qt, const float* __restrict keys, int64_t key_stride,
                        float* __restrict s, int64_t head_dim) {
  if constexpr (W > kVector) {  // wider than a register: each half alone (lanes are independent)
    tile_scores<DC, W / 2>(qt, keys, key_stride, s, head_dim);
    tile_scores<DC, W / 2>(qt + W / 2, keys, key_stride, s + W / 2, head_dim);
    return;
  }
  using Lanes = typename LanesOf<W>::type;
  const int64_t D = DC > 0 ? DC : head_dim;
  for (int64_t r = 0; r < kTile; r += 8) {
    Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
    const float* k = keys + r * key_stride;
    const int64_t S = key_stride;
    for (int64_t d = 0; d < D; ++d) {
      const Lanes qd = load_lanes<W>(qt + d * kLanes);
      a0 += qd * k[d];
      a1 += qd * k[S + d];
      a2 += qd * k[2 * S + d];
      a3 += qd * k[3 * S + d];
      a4 += qd * k[4 * S + d];
      a5 += qd * k[5 * S + d];
      a6 += qd * k[6 * S + d];
      a7 += qd * k[7 * S + d];
    }
    store_lanes<W>(s + r * kLanes, a0);
    store_lanes<W>(s + (r + 1) * kLanes, a1);
    store_lanes<W>(s + (r + 2) * kLanes, a2);
    store_lanes<W>(s + (r + 3) * kLanes, a3);
    store_lanes<W>(s + (r + 4) * kLanes, a4);
    store_lanes<W>(s + (r + 5) * kLanes, a5);
    store_lanes<W>(s + (r + 6) * kLanes, a6);
    store_lanes<W>(s + (r + 7) * kLanes, a7);
  }
}

#if defined(HERON_BF16_PAIRS)
// tile_scores of a bfloat16 pool and bfloat16 queries, on AVX-512 BF16: each lane (a row) sums its query's
// bfloat16 pairs times a key's, read in the pool with no conversion, one VDPBF16PS per pair (the products are
// exact in float32), in order over the head dim; the sum is then scaled. Every lane computes the same thing at
// every width W (4, 8 or 16 lanes in one register), so a row's score does not depend on its row-vector either.
// qp: the rows' queries as pairs, transposed ([D / 2][kLanes]); key_rows: the tile's kTile key rows.
template <int64_t W>
struct PairLanes;
template <>
struct PairLanes<4> {
  using F = __m128;
  static F zero() { return _mm_setzero_ps(); }
  static F dot(F acc, const uint32_t* q, const uint16_t* k) {
    return _mm_dpbf16_ps(acc, (__m128bh)_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)),
                         (__m128bh)_mm_set1_epi32(*reinterpret_cast<const int32_t*>(k)));
  }
  static void store(float* s, F acc, float scale) { _mm_storeu_ps(s, _mm_mul_ps(acc, _mm_set1_ps(scale))); }
};
template <>
struct PairLanes<8> {
  using F = __m256;
  static F zero() { return _mm256_setzero_ps(); }
  static F dot(F acc, const uint32_t* q, const uint16_t* k) {
    return _mm256_dpbf16_ps(acc, (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)),
                            (__m256bh)_mm256_set1_epi32(*reinterpret_cast<const int32_t*>(k)));
  }
  static void store(float* s, F acc, float scale) {
    _mm256_storeu_ps(s, _mm256_mul_ps(acc, _mm256_set1_ps(scale)));
  }
};
template <>
struct PairLanes<16> {
  using F = __m512;
  static F zero() { return _mm512_setzero_ps(); }
  static F dot(F acc, const uint32_t* q, const uint16_t* k) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q),
                            (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(k)));
  }
  static void store(float* s, F acc, float scale) {
    _mm512_storeu_ps(s, _mm512_mul_ps(acc, _mm512_set1_ps(scale)));
  }
};

template <int64_t DC, int64_t W>
inline void pair_scores(const uint32_t* __restrict qp, const uint16_t* const* key_rows, float* __restrict s,
                        float scale, int64_t head_dim) {
  using P = PairLanes<W>;
  const int64_t pairs = (DC > 0 ? DC : head_dim) / 2;
  for (int64_t r = 0; r < kTile; r += 8) {
    typename P::F a0 = P::zero(), a1 = P::zero(), a2 = P::zero(), a3 = P::zero(), a4 = P::zero(),
                  a5 = P::zero(), a6 = P::zero(), a7 = P::zero();
    const uint16_t* const* k = key_rows + r;
    for (int64_t d = 0; d < pairs; ++d) {
      const uint32_t* q = qp + d * kLanes;
      a0 = P::dot(a0, q, k[0] + 2 * d);
      a1 = P::dot(a1, q, k[1] + 2 * d);
      a2 = P::dot(a2, q, k[2] + 2 * d);
      a3 = P::dot(a3, q, k[3] + 2 * d);
      a4 = P::dot(a4, q, k[4] + 2 * d);
      a5 = P::dot(a5, q, k[5] + 2 * d);
      a6 = P::dot(a6, q, k[6] + 2 * d);
      a7 = P::dot(a7, q, k[7] + 2 * d);
    }
    P::store(s + r * kLanes, a0, scale);
    P::store(s + (r + 1) * kLanes, a1, scale);
    P::store(s + (r + 2) * kLanes, a2, scale);
    P::store(s + (r + 3) * kLanes, a3, scale);
    P::store(s + (r + 4) * kLanes, a4, scale);
    P::store(s + (r + 5) * kLanes, a5, scale);
    P::store(s + (r + 6) * kLanes, a6, scale);
    P::store(s + (r + 7) * kLanes, a7, scale);
  }
}

// A float8 row in bfloat16 (exact), sixteen codes at a time (D: a multiple of 16).
template <typename F8>
inline void load_bf16_row(const F8* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(to_f32x16(src + i)));
  }
}
#endif

// A row's accumulator: acc = acc * correction + sum over keys [r0, r1) of the tile, in order, of
// p[r * p_stride] * value_r (values: kTile rows of D, value_stride apart). One form for every row (it depends on
// the head dim only).
template <int64_t DC>
inline void accumulate(float* __restrict acc, const float* __restrict values, int64_t value_stride,
                       const float* __restrict p, int64_t p_stride, int64_t r0, int64_t r1, float correction,
                       int64_t head_dim) {
  if constexpr (DC > 0 && DC % kVector == 0) {
    using Lanes = typename LanesOf<kVector>::type;
    constexpr int64_t N = DC / kVector;
    Lanes a[N];
    for (int64_t c = 0; c < N; ++c) a[c] = load_lanes<kVector>(acc + c * kVector) * correction;
    for (int64_t r = r0; r < r1; ++r) {
      const float w = p[r * p_stride];
      const float* v = values + r * value_stride;
      for (int64_t c = 0; c < N; ++c) a[c] += load_lanes<kVector>(v + c * kVector) * w;
    }
    for (int64_t c = 0; c < N; ++c) store_lanes<kVector>(acc + c * kVector, a[c]);
  } else {
    const int64_t D = DC > 0 ? DC : head_dim;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
    for (int64_t r = r0; r < r1; ++r) {
      const float w = p[r * p_stride];
      const float* v = values + r * value_stride;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += w * v[d];
    }
  }
}

// Scores of the positions a row does not attend (before first, after pos) become -inf; the tile starts at j0.
// Positions of the tile outside the unit's range are attended by none of its rows. W: the row-vector's lanes
// in use (the rest are padding, never read).
template <int64_t W>
inline void mask_tile(float* __restrict s, const int32_t* __restrict pos, const int32_t* __restrict first,
                      int32_t j0) {
  for (int64_t r = 0; r < kTile; ++r) {
    const int32_t j = j0 + static_cast<int32_t>(r);
#pragma omp simd
    for (int64_t l = 0; l < W; ++l) {
      const bool ok = (j <= pos[l]) & (j >= first[l]);
      s[r * kLanes + l] = ok ? s[r * kLanes + l] : -std::numeric_limits<float>::infinity();
    }
  }
}

// The online-softmax step of one row-vector over a tile: s holds its scores (-inf where not attended) and
// gets their weights e^(s - new max); the running max and denominator move on, correction = e^(old - new max),
// exactly 1 where the max stays (so a row with no position in the tile keeps its state bit for bit, and a tile
// that others' positions bring in changes nothing of its). Each row's sum runs over the tile's keys in order.
// W: the lanes in use; every loop runs over lanes, so it vectorizes.
template <int64_t W>
inline void softmax_step(float* __restrict s, float* __restrict max, float* __restrict denom,
                         float* __restrict correction) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  float new_max[W], sum[W] = {};
  for (int64_t l = 0; l < W; ++l) new_max[l] = max[l];
  for (int64_t r = 0; r < kTile; ++r) {
#pragma omp simd
    for (int64_t l = 0; l < W; ++l) new_max[l] = std::max(new_max[l], s[r * kLanes + l]);
  }
  // the selects compare bits (both maxima are finite; -inf has one code), which GCC vectorizes where it leaves a
  // ?: between floats scalar
#pragma omp simd
  for (int64_t l = 0; l < W; ++l) {
    const float c = exp_approx(max[l] - new_max[l]);
    correction[l] = float_of(select_bits(bits_of(max[l]) == bits_of(new_max[l]), bits_of(1.0f), bits_of(c)));
  }
  for (int64_t r = 0; r < kTile; ++r) {
#pragma omp simd
    for (int64_t l = 0; l < W; ++l) {
      const float x = s[r * kLanes + l], e = exp_approx(x - new_max[l]);
      const float p = float_of(select_bits(bits_of(x) == bits_of(neg_inf), 0u, bits_of(e)));  // not attended: 0
      s[r * kLanes + l] = p;
      sum[l] += p;
    }
  }
  for (int64_t l = 0; l < W; ++l) {
    denom[l] = denom[l] * correction[l] + sum[l];
    max[l] = new_max[l];
  }
}

// Merges one chunk's state (m, l, a) of a row into the row's merged state (M, L, A): chunks are always merged
// one by one in position order, by this one function (not inlined: one compiled form of its arithmetic), whether
// a thread takes a unit's chunks in turn or several threads took them. A chunk with no position of the row's
// (m = kNoMax, l = 0, a = 0) changes nothing.
#if defined(__GNUC__) && !defined(__clang__)
#define MERGE_ATTRS __attribute__((noinline, noclone))
#elif defined(__GNUC__)
#define MERGE_ATTRS __attribute__((noinline))
#else
#define MERGE_ATTRS
#endif
MERGE_ATTRS void merge_state(float& M, float& L, float* __restrict A, float m, float l,
                                   const float* __restrict a, int64_t D) {
  const float nm = std::max(M, m);
  const float cM = M == nm ? 1.0f : std::exp(M - nm);
  const float cm = m == nm ? 1.0f : std::exp(m - nm);
  L = L * cM + l * cm;
  for (int64_t d = 0; d < D; ++d) A[d] = A[d] * cM + a[d] * cm;
  M = nm;
}

// Whether bfloat16 scores take pair_scores here. VDPBF16PS retires two a cycle on AMD Zen 4, as many as FMAs,
// so a pair (two multiply-adds) costs half a float32 FMA's; on Intel's cores (Sapphire Rapids and later) it
// retires one every two cycles, a quarter of the FMA's rate, so the float32 form is twice as fast there
// (docs/performance.md). HERON_BF16_PAIRS=0 / 1 overrides the choice.
bool bf16_pairs_fast() {
  static const bool fast = [] {
    const char* setting = std::getenv("HERON_BF16_PAIRS");
    if (setting != nullptr && std::string(setting) == "0") return false;
    if (setting != nullptr && std::string(setting) == "1") return true;
#if defined(__GNUC__) && defined(__x86_64__)
    return __builtin_cpu_is("amd") != 0;
#else
    return false;
#endif
  }();
  return fast;
}

// Whether the pair scores apply (bfloat16 queries on AVX-512 BF16, a bfloat16 or float8 pool, a head dim fixed at
// compile time): elsewhere attend's PAIRS changes nothing, and only its false form is built.
template <int64_t DC, typename T, typename C>
constexpr bool kPairsApply =
#if defined(HERON_BF16_PAIRS)
    DC > 0 && std::is_same_v<T, at::BFloat16> &&
    (std::is_same_v<C, at::BFloat16> || std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>);
#else
    false;
#endif

// T: q's and the output's dtype; C: the pool's (T, or float8); DC: the head dim when fixed at compile time (0:
// head_dim); PAIRS: bfloat16 scores from pairs where the types allow (bf16_pairs_fast). scale: the softmax scale
// times k_scale, applied to the query; v_scale: applied with 1 / the sum.
template <int64_t DC, bool PAIRS, typename T, typename C>
void attend(const T* q, int64_t q_stride, const C* cache, const int32_t* block_table, const int32_t* seq_lens,
            const int32_t* query_begin, const int32_t* query_end, T* out, int64_t num_seqs, int64_t num_heads,
            int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t table_width,
            float scale, int64_t window, float v_scale) {
  const int64_t D = DC > 0 ? DC : head_dim;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_heads * head_dim;   // out: [T, H, D]; q's rows may be strided
  // cache: [2, NB, KVH, BS, D]: a KV head's positions of a block lie together, so a tile's rows are one run
  const int64_t head_stride = block_size * head_dim;
  const int64_t block_stride = num_kv_heads * head_stride;
  const int64_t value_offset = num_blocks * block_stride;
  const int64_t BS = block_size;
  // a float32 pool whose blocks hold whole tiles is read where it lies, not copied into float32 scratch first
  const bool in_place = std::is_same_v<C, float> && BS % kTile == 0;
  // bfloat16 queries on AVX-512 BF16: scores from bfloat16 pairs (pair_scores), keys read in a bfloat16 pool, or
  // a float8 pool's converted to bfloat16 (exactly: every float8 value is a bfloat16 one)
  constexpr bool pairs = PAIRS && kPairsApply<DC, T, C>;

  // The units, their cost (rows x positions), and how many items each is spread over.
  std::vector<Unit> units;
  double total_cost = 0.0;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t num_q = query_end[b] - query_begin[b], seq_len = seq_lens[b];
    for (int64_t i0 = 0; i0 < num_q; i0 += kUnitQueries) {
      const int64_t i1 = std::min(num_q, i0 + kUnitQueries);
      const int64_t pos0 = seq_len - num_q + i0;
      const int64_t key_begin = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0;
      const int64_t key_end = std::max(key_begin, seq_len - num_q + i1);
      for (int64_t kvh = 0; kvh < num_kv_heads; ++kvh) {
        units.push_back({b, kvh, query_begin[b] + i0, query_begin[b] + i1, num_q, seq_len, key_begin, key_end,
                         key_begin / kChunk, (key_end + kChunk - 1) / kChunk, 1, 0});
        total_cost += static_cast<double>((i1 - i0) * group) * (key_end - key_begin);
      }
    }
  }
  if (units.empty()) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  std::vector<Item> items;
  int64_t partial_size = 0;
  // few units for the threads: spread their chunks over several items, so that each thread gets about
  // kPartsPerThread items. How they are spread changes no bit of the result, only who computes what.
  const double target = total_cost / static_cast<double>(threads * kPartsPerThread);
  for (int64_t u = 0; u < static_cast<int64_t>(units.size()); ++u) {
    Unit& unit = units[u];
    const int64_t rows = (unit.q1 - unit.q0) * group, chunks = unit.chunk1 - unit.chunk0;
    int64_t parts = 1;
    if (threads > 1) {
      const double cost = static_cast<double>(rows) * (unit.key_end - unit.key_begin);
      parts = std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(std::ceil(cost / target)), chunks));
    }
    unit.parts = parts;
    unit.partial = partial_size;
    if (parts > 1) partial_size += chunks * rows * (D + 2);
    for (int64_t p = 0; p < parts; ++p) {
      items.push_back({u, unit.chunk0 + chunks * p / parts, unit.chunk0 + chunks * (p + 1) / parts});
    }
  }
  std::vector<float> partial(partial_size);
  std::unique_ptr<std::atomic<int64_t>[]> remaining(new std::atomic<int64_t>[units.size()]);
  for (size_t u = 0; u < units.size(); ++u) remaining[u].store(units[u].parts, std::memory_order_relaxed);
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());

  // A row's output: acc * v_scale / denom, into the output tensor (tmp: D floats of scratch).
  const auto write_out = [&](const Unit& unit, int64_t row, const float* acc, float denom, float* tmp) {
    const int64_t t = unit.q0 + row / group, h = unit.kvh * group + row % group;
    const float inv = v_scale / denom;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) tmp[d] = acc[d] * inv;
    store_row(tmp, out + t * token_stride + h * D, D);
  };

  const auto work = [&](Scratch& s, const Item& item) {
    const Unit& unit = units[item.unit];
    const int64_t rows = (unit.q1 - unit.q0) * group;
    const int64_t vectors = (rows + kLanes - 1) / kLanes, padded = vectors * kLanes;
    const bool whole = unit.parts == 1;
    if constexpr (pairs) {
      s.qp.assign(vectors * D / 2 * kLanes, 0u);
    } else {
      s.qf.resize(rows * D);
      s.qt.assign(vectors * D * kLanes, 0.0f);
    }
    s.acc.resize(rows * D);
    s.max.resize(padded);
    s.denom.resize(padded);
    s.pos.assign(padded, -1);  // padding rows: no position of theirs
    s.first.assign(padded, 0);
    if (whole) {
      s.merged_max.assign(rows, kNoMax);
      s.merged_denom.assign(rows, 0.0f);
      s.merged_acc.assign(rows * D, 0.0f);
    }
    if (s.keys.size() < static_cast<size_t>(kTile * D)) {
      s.key_bits.assign(kTile * D, 0);
      s.keys.assign(kTile * D, 0.0f);
      s.values.assign(kTile * D, 0.0f);
      s.scores.assign(kTile * kLanes, 0.0f);
      s.row.assign(D, 0.0f);
    }
    const int32_t* table = block_table + unit.b * table_width;
    const C* head = cache + unit.kvh * head_stride;
    // the key row of position j (its value row lies value_offset further)
    const auto key_row = [&](int64_t j) {
      return head + static_cast<int64_t>(table[j / BS]) * block_stride + j % BS * D;
    };
    for (int64_t row = 0; row < rows; ++row) {
      const int64_t i = unit.q0 + row / group, g = row % group;
      const T* qrow = q + i * q_stride + (unit.kvh * group + g) * D;
      if constexpr (pairs) {  // unscaled: pair_scores scales the sums
        const uint16_t* bits = reinterpret_cast<const uint16_t*>(qrow);
        uint32_t* qp = s.qp.data() + (row / kLanes) * (D / 2) * kLanes + row % kLanes;
        for (int64_t d = 0; d < D / 2; ++d) {
          qp[d * kLanes] = static_cast<uint32_t>(bits[2 * d]) | (static_cast<uint32_t>(bits[2 * d + 1]) << 16);
        }
      } else {
        float* qr = s.qf.data() + row * D;
        load_row(qrow, qr, D);
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) qr[d] *= scale;
        float* qt = s.qt.data() + (row / kLanes) * D * kLanes + row % kLanes;
        for (int64_t d = 0; d < D; ++d) qt[d * kLanes] = qr[d];
      }
      const int64_t pos = unit.seq_len - unit.num_q + (i - query_begin[unit.b]);
      s.pos[row] = static_cast<int32_t>(pos);
      s.first[row] = static_cast<int32_t>(window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
    }
    float* sc = s.scores.data();
    for (int64_t chunk = item.chunk0; chunk < item.chunk1; ++chunk) {
      // the chunk's state, from scratch
      std::fill(s.acc.begin(), s.acc.end(), 0.0f);
      std::fill(s.max.begin(), s.max.end(), kNoMax);
      std::fill(s.denom.begin(), s.denom.end(), 0.0f);
      const int64_t lo = std::max(unit.key_begin, chunk * kChunk), hi = std::min(unit.key_end, (chunk + 1) * kChunk);
      for (int64_t j0 = lo / kTile * kTile; j0 < hi; j0 += kTile) {
        const float* keys = s.keys.data();
        const float* values = s.values.data();
        const uint16_t* key_rows[kTile];  // pairs: the tile's keys in the pool
        if constexpr (pairs) {
          // positions outside the unit's [lo, hi) are attended by no row (masked): they read a row that exists
          const int64_t a = std::max(lo, j0), z = std::min(hi, j0 + kTile);
          for (int64_t r = 0; r < kTile; ++r) {
            const int64_t j = std::min(std::max(j0 + r, a), z - 1);
            const C* src = key_row(j);
            if constexpr (std::is_same_v<C, at::BFloat16>) {
              key_rows[r] = reinterpret_cast<const uint16_t*>(src);
            } else {  // float8: the key in bfloat16 scratch, converted once (its clamped copies point at it)
#if defined(HERON_BF16_PAIRS)
              uint16_t* row = s.key_bits.data() + (j - j0) * D;
              if (j == j0 + r) load_bf16_row(src, row, D);
              key_rows[r] = row;
#endif
            }
            if (j == j0 + r) load_row(src + value_offset, s.values.data() + r * D, D);
          }
        } else if (in_place) {  // read in the pool: the tile lies in one block; positions no row attends are masked
          keys = reinterpret_cast<const float*>(key_row(j0));
          values = keys + value_offset;
        } else {
          const int64_t a = std::max(lo, j0), z = std::min(hi, j0 + kTile);  // the tile's positions to read
          for (int64_t j = a; j < z;) {  // block by block
            const int64_t run = std::min(BS - j % BS, z - j);
            const C* src = key_row(j);
            for (int64_t x = 0; x < run; ++x, ++j) {
              load_row(src + x * D, s.keys.data() + (j - j0) * D, D);
              load_row(src + value_offset + x * D, s.values.data() + (j - j0) * D, D);
            }
          }
        }
#if defined(__GNUC__)
        // the next tile's rows, to be in cache by its turn (the block table scatters them past the prefetchers);
        // into L2 (prefetcht1): decode of 32 sequences from memory 1.19-1.34x faster than into L1 on Zen 4
        for (int64_t j = j0 + kTile; j < std::min(j0 + 2 * kTile, unit.key_end); ++j) {
          const C* row = key_row(j);
          for (int64_t byte = 0; byte < D * static_cast<int64_t>(sizeof(C)); byte += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(row) + byte, 0, 2);
            __builtin_prefetch(reinterpret_cast<const char*>(row + value_offset) + byte, 0, 2);
          }
        }
#endif
        const int32_t jlast = static_cast<int32_t>(j0 + kTile - 1);
        for (int64_t v = 0; v < vectors; ++v) {
          const int64_t row0 = v * kLanes, nrows = std::min(kLanes, rows - row0);
          const int32_t* pos = s.pos.data() + row0;
          const int32_t* first = s.first.data() + row0;
          // rows are in position order: skip a vector none of whose rows reach into the tile
          if (pos[nrows - 1] < j0 || first[0] > jlast) continue;
          const float* qt = pairs ? nullptr : s.qt.data() + v * D * kLanes;
          // every row of the vector attends every position of the tile: nothing to mask
          const bool full = pos[0] >= jlast && first[nrows - 1] <= j0;
          float correction[kLanes];
          const auto score = [&](auto width) {
            constexpr int64_t W = decltype(width)::value;
            if constexpr (pairs) {
#if defined(HERON_BF16_PAIRS)
              pair_scores<DC, W>(s.qp.data() + v * (D / 2) * kLanes, key_rows, sc, scale, D);
#endif
            } else {
              tile_scores<DC, W>(qt, keys, D, sc, D);
            }
            if (!full) mask_tile<W>(sc, pos, first, static_cast<int32_t>(j0));
            softmax_step<W>(sc, s.max.data() + row0, s.denom.data() + row0, correction);
          };
          if (nrows <= 4) {
            score(std::integral_constant<int64_t, 4>{});
          } else if (nrows <= 8) {
            score(std::integral_constant<int64_t, 8>{});
          } else {
            score(std::integral_constant<int64_t, kLanes>{});
          }
          for (int64_t l = 0; l < nrows; ++l) {
            const int64_t r0 = std::max<int64_t>(0, first[l] - j0), r1 = std::min<int64_t>(kTile, pos[l] - j0 + 1);
            if (r0 >= r1) continue;  // nothing of this row's in the tile: its state is unchanged
            accumulate<DC>(s.acc.data() + (row0 + l) * D, values, D, sc + l, kLanes, r0, r1,
                           correction[l], D);
          }
        }
      }
      if (whole) {  // merged in turn
        for (int64_t row = 0; row < rows; ++row) {
          merge_state(s.merged_max[row], s.merged_denom[row], s.merged_acc.data() + row * D, s.max[row],
                      s.denom[row], s.acc.data() + row * D, D);
        }
      } else {  // kept for the unit's last item to merge
        float* mine = partial.data() + unit.partial + (chunk - unit.chunk0) * rows * (D + 2);
        std::memcpy(mine, s.max.data(), rows * sizeof(float));
        std::memcpy(mine + rows, s.denom.data(), rows * sizeof(float));
        std::memcpy(mine + 2 * rows, s.acc.data(), rows * D * sizeof(float));
      }
    }
    if (whole) {
      for (int64_t row = 0; row < rows; ++row) {
        write_out(unit, row, s.merged_acc.data() + row * D, s.merged_denom[row], s.row.data());
      }
      return;
    }
    if (remaining[item.unit].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    // the unit's last item to finish merges its chunks, in order
    const int64_t chunk_size = rows * (D + 2);
    const float* chunks = partial.data() + unit.partial;
    s.merged_acc.resize(D);
    for (int64_t row = 0; row < rows; ++row) {
      float M = kNoMax, L = 0.0f;
      float* A = s.merged_acc.data();
      std::fill(A, A + D, 0.0f);
      for (int64_t c = 0; c < unit.chunk1 - unit.chunk0; ++c) {
        const float* st = chunks + c * chunk_size;
        merge_state(M, L, A, st[row], st[rows + row], st + 2 * rows + row * D, D);
      }
      write_out(unit, row, A, L, s.row.data());
    }
  };

  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    Scratch s;
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < num_items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      work(s, items[i]);
    }
  });
}

}  // namespace

// q: [T, H, D] (rows may be strided); kv_cache: [2, NB, KVH, BS, D] (q's dtype, or float8 holding k / k_scale
// and v / v_scale); block_table: [B, W] int32; seq_lens: [B] int32;
// query_begin, query_end: [B] int32, sequence b's queries are rows [begin, end) of q (an empty range skips it:
// its rows of the result are left for another path). Returns [T, H, D].
at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                           at::Tensor seq_lens, at::Tensor query_begin, at::Tensor query_end,
                           double scale, int64_t window, double k_scale, double v_scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(4) == q.size(2) &&
              q.size(1) % kv_cache.size(2) == 0,
              "a pool [2, blocks, kv_heads, block_size, head_dim] of q's head dim, whose KV heads divide q's heads");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && kv_cache.is_contiguous() &&
              block_table.is_contiguous(), "contiguous heads of q, a contiguous pool and block table");
  const auto pool = kv_cache.scalar_type();
  TORCH_CHECK(pool == q.scalar_type() || pool == at::kFloat8_e4m3fn || pool == at::kFloat8_e5m2,
              "the KV cache must hold q's dtype or float8");
  auto out = at::empty(q.sizes(), q.options());
  HERON_DISPATCH_MODEL_TYPES(q.scalar_type(), "paged_attention", [&] {
    const auto run = [&](const auto* cache) {
      const auto call = [&](auto head_dim) {
        const auto with = [&](auto pairs) {
          attend<decltype(head_dim)::value, decltype(pairs)::value>(
              q.data_ptr<scalar_t>(), q.stride(0), cache, block_table.data_ptr<int32_t>(),
              seq_lens.data_ptr<int32_t>(), query_begin.data_ptr<int32_t>(), query_end.data_ptr<int32_t>(),
              out.data_ptr<scalar_t>(), seq_lens.size(0), q.size(1), kv_cache.size(2), q.size(2),
              kv_cache.size(3), kv_cache.size(1), block_table.size(1), static_cast<float>(scale * k_scale), window,
              static_cast<float>(v_scale));
        };
        using C = std::remove_cv_t<std::remove_pointer_t<decltype(cache)>>;
        if constexpr (kPairsApply<decltype(head_dim)::value, scalar_t, C>) {
          if (bf16_pairs_fast()) return with(std::true_type{});
        }
        with(std::false_type{});
      };
      if (q.size(2) == 64) {
        call(std::integral_constant<int64_t, 64>{});
      } else if (q.size(2) == 128) {
        call(std::integral_constant<int64_t, 128>{});
      } else {
        call(std::integral_constant<int64_t, 0>{});
      }
    };
    if (pool == at::kFloat8_e4m3fn) {
      run(kv_cache.data_ptr<c10::Float8_e4m3fn>());
    } else if (pool == at::kFloat8_e5m2) {
      run(kv_cache.data_ptr<c10::Float8_e5m2>());
    } else {
      run(kv_cache.data_ptr<scalar_t>());
    }
  });
  return out;
}
