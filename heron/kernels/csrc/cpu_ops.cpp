// Fused small ops and a one-row matmul for the CPU decode path. A decode step of a small model is thousands of
// tiny tensor ops; each of these replaces three to eight of them (one pass over the data instead of several,
// one dispatch instead of several), computing in float32 and rounding once to the tensor's dtype.
// pybind11 and ATen's type casters, not all of torch/extension.h (see float_rows.h)
#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include "float_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

using namespace heron;

template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t H, float eps) {
  std::vector<float> w(H);
  load_row(weight, w.data(), H);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H), other(H);
    for (int64_t t = begin; t < end; ++t) {
      load_row(x + t * H, row.data(), H);
      if (residual != nullptr) {
        load_row(residual + t * H, other.data(), H);
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) row[i] = round_to(T(), row[i] + other[i]);  // kept in T, as x + r is
        store_row(row.data(), residual + t * H, H);
      }
      float sum_sq = 0.0f;
#pragma omp simd reduction(+ : sum_sq)
      for (int64_t i = 0; i < H; ++i) sum_sq += row[i] * row[i];
      const float inv = 1.0f / std::sqrt(sum_sq / static_cast<float>(H) + eps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) row[i] = w[i] * round_to(T(), row[i] * inv);
      store_row(row.data(), out + t * H, H);
    }
  });
}

template <typename T>
void rotate(T* x, int64_t heads, int64_t D, const float* cos, const float* sin, float* buf) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    T* r = x + h * D;
    load_row(r, buf, D);
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = buf[i], x2 = buf[half + i];
      buf[i] = x1 * cos[i] - x2 * sin[i];
      buf[half + i] = x2 * cos[i] + x1 * sin[i];
    }
    store_row(buf, r, D);
  }
}

// e^-gate goes through a buffer of its own: fused into the loop of the division, GCC 12 (with
// -fno-trapping-math) vectorized that loop ~15x slower than the two loops apart (the same operations, the same bits)
template <typename T>
void silu_and_mul_row(const T* x, T* out, int64_t I, float* gate, float* up, float* exp_neg) {
  load_row(x, gate, I);
  load_row(x + I, up, I);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) exp_neg[i] = exp_approx(-gate[i]);
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) gate[i] = gate[i] / (1.0f + exp_neg[i]) * up[i];
  store_row(gate, out, I);
}

#if defined(__AVX512BF16__)
// One output row block of y = x W^T for R rows of x, NR rows of W: W is read once, at memory speed, with
// bf16 pairs multiplied and summed into float32 lanes (vdpbf16ps).
template <int R>
void gemv_block(const uint16_t* x, const uint16_t* w, const float* bias, int64_t K, int64_t n0, int64_t n1,
                at::BFloat16* y, int64_t N) {
  constexpr int NR = 4;
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    __m512 acc[R][NR];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : ((__mmask32(1) << (K - k)) - 1);
      __m512i wv[NR];
      for (int j = 0; j < NR; ++j) {
        wv[j] = j < nr ? _mm512_maskz_loadu_epi16(mask, w + (n + j) * K + k) : _mm512_setzero_si512();
        // rows are short streams: fetch the next row block ahead of the hardware prefetcher
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + 2 * NR + j) * K + k), _MM_HINT_T0);
      }
      for (int r = 0; r < R; ++r) {
        const __m512i xv = _mm512_maskz_loadu_epi16(mask, x + r * K + k);
        for (int j = 0; j < NR; ++j)
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)xv, (__m512bh)wv[j]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < nr; ++j)
        y[r * N + n + j] = at::BFloat16(_mm512_reduce_add_ps(acc[r][j]) + (bias ? bias[n + j] : 0.0f));
  }
}
#endif

void gemv_rows(const uint16_t* x, const uint16_t* w, const float* bias, int64_t M, int64_t K, int64_t n0,
               int64_t n1, at::BFloat16* y, int64_t N) {
#if defined(__AVX512BF16__)
  switch (M) {
    case 1: return gemv_block<1>(x, w, bias, K, n0, n1, y, N);
    case 2: return gemv_block<2>(x, w, bias, K, n0, n1, y, N);
    case 3: return gemv_block<3>(x, w, bias, K, n0, n1, y, N);
    default: return gemv_block<4>(x, w, bias, K, n0, n1, y, N);
  }
#else
  const auto* xb = reinterpret_cast<const at::BFloat16*>(x);
  const auto* wb = reinterpret_cast<const at::BFloat16*>(w);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < M; ++r) {
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t k = 0; k < K; ++k) s += to_f32(xb + r * K + k) * to_f32(wb + n * K + k);
      y[r * N + n] = at::BFloat16(s + (bias ? bias[n] : 0.0f));
    }
#endif
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

}  // namespace

// out = norm(x) * weight; with residual: residual += x (in place), out = norm(residual) * weight.
at::Tensor rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: contiguous x and a weight of x's dtype");
  const int64_t H = x.size(-1), rows = x.numel() / H;
  if (residual.has_value())
    TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes() &&
                residual->scalar_type() == x.scalar_type(), "rms_norm: residual like x");
  auto out = at::empty_like(x);
  HERON_DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                            weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, H, static_cast<float>(eps));
  });
  return out;
}

// Rotate-half RoPE applied in place to q [T, H, D] and k [T, KVH, D] (rows may be strided views of a fused
// projection); cos and sin: float32 [max_positions, D] tables, looked up at positions [T] (int64).
void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos,
                      at::Tensor sin) {
  check_cpu(q, "q");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1 && q.stride(1) == q.size(2) &&
              k.stride(1) == k.size(2) && q.scalar_type() == k.scalar_type(), "rotary_embedding: q, k layout");
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.scalar_type() == at::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "rotary_embedding: int64 positions, float32 tables");
  const int64_t T = q.size(0), D = q.size(2);
  const int64_t* pos = positions.data_ptr<int64_t>();
  HERON_DISPATCH_MODEL_TYPES(q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(D);
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos.data_ptr<float>() + pos[t] * cos.size(1);
        const float* s = sin.data_ptr<float>() + pos[t] * sin.size(1);
        rotate(qp + t * q.stride(0), q.size(1), D, c, s, buf.data());
        rotate(kp + t * k.stride(0), k.size(1), D, c, s, buf.data());
      }
    });
  });
}

// SwiGLU on a fused gate/up projection: x [T, 2I] -> silu(x[:, :I]) * x[:, I:], [T, I].
at::Tensor silu_and_mul(at::Tensor x) {
  check_cpu(x, "x");
  TORCH_CHECK(x.is_contiguous(), "silu_and_mul: contiguous x");
  const int64_t I = x.size(-1) / 2, rows = x.numel() / x.size(-1);
  auto sizes = x.sizes().vec();
  sizes.back() = I;
  auto out = at::empty(sizes, x.options());
  HERON_DISPATCH_MODEL_TYPES(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> gate(I), up(I), exp_neg(I);
      for (int64_t t = begin; t < end; ++t)
        silu_and_mul_row(xp + t * 2 * I, op + t * I, I, gate.data(), up.data(), exp_neg.data());
    });
  });
  return out;
}

// y = x W^T (+ bias) for a few bfloat16 rows x [M <= 4, K] and a dense W [N, K]; float32 accumulation.
at::Tensor gemv_bf16(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
  check_cpu(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 && x.dim() == 2 &&
              x.size(0) <= 4 && x.is_contiguous() && weight.is_contiguous() && x.size(1) == weight.size(1),
              "gemv_bf16: bfloat16 x [M <= 4, K] and W [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;  // (gemv_rows has no form for zero rows)
  at::Tensor bias_f32;
  if (bias.has_value()) bias_f32 = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  // chunks of 64 output rows: even work per thread, and each thread streams its own part of W
  at::parallel_for(0, (N + 63) / 64, 1, [&](int64_t begin, int64_t end) {
    gemv_rows(xp, wp, bp, M, K, begin * 64, std::min(end * 64, N), yp, N);
  });
  return y;
}

namespace {

// One row of keys or values into a float8 pool: x / scale in float32, saturated (float_rows.h). Divides, as the
// PyTorch form (quantization/kv.py) does, so both store the same bytes.
template <typename T, typename F8>
void quantize_kv_row(const T* src, F8* dst, int64_t n, float scale, float* buf) {
  load_row(src, buf, n);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) buf[i] /= scale;
  store_row(buf, dst, n);
}

}  // namespace

// Writes this step's keys and values [T, KVH, D] (strided rows allowed) into slots of the paged pool
// [2, NB, KVH, BS, D] (slot s: position s % BS of block s / BS); a negative slot skips the token. A pool of k's
// dtype gets a copy; a float8 pool (an fp8 KV cache) gets k / k_scale and v / v_scale.
void store_kv(at::Tensor k, at::Tensor v, at::Tensor kv_cache, at::Tensor slots, double k_scale,
              double v_scale) {
  check_cpu(kv_cache, "kv_cache");
  const auto pool = kv_cache.scalar_type();
  const bool quantize = pool != k.scalar_type() && (pool == at::kFloat8_e4m3fn || pool == at::kFloat8_e5m2);
  TORCH_CHECK((quantize || pool == k.scalar_type()) && v.scalar_type() == k.scalar_type() &&
              kv_cache.is_contiguous() && slots.scalar_type() == at::kLong && k.stride(2) == 1 &&
              k.stride(1) == k.size(2) && v.stride(2) == 1 && v.stride(1) == v.size(2), "store_kv: layouts");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(2) == KVH && kv_cache.size(4) == D,
              "store_kv: the pool's KV heads and head dim must be k's");
  const int64_t BS = kv_cache.size(3), num_slots = kv_cache.size(1) * BS, value_offset = num_slots * KVH * D;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slot[t] < num_slots, "store_kv: slot out of range");
  // where head h of slot s lies, in elements from the pool's keys (its value: value_offset further)
  const auto place = [&](int64_t s, int64_t h) { return ((s / BS) * KVH + h) * BS * D + s % BS * D; };
  if (!quantize) {
    const int64_t elem = kv_cache.element_size();
    char* base = static_cast<char*>(kv_cache.data_ptr());
    const char* kp = static_cast<const char*>(k.data_ptr());
    const char* vp = static_cast<const char*>(v.data_ptr());
    for (int64_t t = 0; t < T; ++t) {
      if (slot[t] < 0) continue;
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t at = place(slot[t], h);
        std::memcpy(base + at * elem, kp + (t * k.stride(0) + h * D) * elem, D * elem);
        std::memcpy(base + (value_offset + at) * elem, vp + (t * v.stride(0) + h * D) * elem, D * elem);
      }
    }
    return;
  }
  HERON_DISPATCH_MODEL_TYPES(k.scalar_type(), "store_kv", [&] {
    const scalar_t* kp = k.data_ptr<scalar_t>();
    const scalar_t* vp = v.data_ptr<scalar_t>();
    const auto write = [&](auto* keys) {  // keys: the pool's first half, values follow
      auto* values = keys + value_offset;
      // a long prefill chunk is thousands of rows, each converted element by element: split them over threads,
      // but only past ~64K elements a thread (a decode batch's rows cost less than a parallel region)
      at::parallel_for(0, T, std::max<int64_t>(1, (int64_t{1} << 16) / (KVH * D)), [&](int64_t begin, int64_t end) {
        std::vector<float> buf(D);
        for (int64_t t = begin; t < end; ++t) {
          if (slot[t] < 0) continue;
          for (int64_t h = 0; h < KVH; ++h) {
            const int64_t at = place(slot[t], h);
            quantize_kv_row(kp + t * k.stride(0) + h * D, keys + at, D, static_cast<float>(k_scale), buf.data());
            quantize_kv_row(vp + t * v.stride(0) + h * D, values + at, D, static_cast<float>(v_scale), buf.data());
          }
        }
      });
    };
    if (pool == at::kFloat8_e4m3fn) {
      write(kv_cache.data_ptr<c10::Float8_e4m3fn>());
    } else {
      write(kv_cache.data_ptr<c10::Float8_e5m2>());
    }
  });
}

// Each row's argmax, the first on ties, a NaN counting above every number (as torch.max(dim) returns them):
// one vectorized pass for the row's maximum (and whether it has a NaN), one that stops at its first index.
at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "float32 rows [M, V] with contiguous columns");
  const int64_t rows = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(V > 0, "rows of at least one logit");
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* index = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      // 64 lanes of running maxima (four registers' worth of independent chains), then the tail
      constexpr int64_t L = 64;
      float lanes[L];
      int32_t nans[L];
      for (int64_t l = 0; l < L; ++l) lanes[l] = -std::numeric_limits<float>::infinity(), nans[l] = 0;
      int64_t i = 0;
      for (; i + L <= V; i += L) {
#pragma omp simd
        for (int64_t l = 0; l < L; ++l) {
          const float v = row[i + l];
          lanes[l] = lanes[l] > v ? lanes[l] : v;
          nans[l] |= v != v;
        }
      }
      float best = -std::numeric_limits<float>::infinity();
      bool nan = false;
      for (int64_t l = 0; l < L; ++l) best = std::max(best, lanes[l]), nan |= nans[l] != 0;
      for (; i < V; ++i) best = std::max(best, row[i]), nan |= row[i] != row[i];
      int64_t at = 0;
      if (nan) {
        while (row[at] == row[at]) ++at;
      } else {
        while (row[at] != best) ++at;
      }
      index[r] = at;
    }
  });
  return out;
}

at::Tensor paged_attention(at::Tensor q, at::Tensor kv_cache, at::Tensor block_table,
                           at::Tensor seq_lens, at::Tensor query_begin, at::Tensor query_end,
                           double scale, int64_t window, double k_scale, double v_scale);
at::Tensor int_linear(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                      int64_t bits, int64_t group, int64_t n, c10::optional<at::Tensor> bias);
int64_t int_linear_amx_rows();
at::Tensor int_linear_row_scale(at::Tensor x, at::Tensor qweight, at::Tensor scales, at::Tensor mins,
                                int64_t n, c10::optional<at::Tensor> bias);
bool row_scale_available();
at::Tensor tile_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias, int64_t n);
bool tile_linear_available();
bool tile_linear_amx();

void bind_decoder_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm, fused with the residual add when given one");
  m.def("argmax_rows", &argmax_rows, "each float32 row's argmax (the first on ties; NaN above all)");
  m.def("rotary_embedding", &rotary_embedding, "rotate-half RoPE in place on q and k");
  m.def("silu_and_mul", &silu_and_mul, "SwiGLU of a fused gate/up projection");
  m.def("gemv_bf16", &gemv_bf16, "bfloat16 y = x W^T for a few rows, at memory speed");
  m.def("int_linear", &int_linear, "y = x W^T for a packed 4/8-bit W, int8 activations (AVX-512 VNNI, AMX)");
  m.def("int_linear_row_scale", &int_linear_row_scale,
        "y = x W^T for an 8-bit packed W with one scale per output row, applied once (AVX-512 VNNI)");
  m.def("row_scale_available", &row_scale_available, "whether int_linear_row_scale runs on this CPU");
  m.def("int_linear_amx_rows", &int_linear_amx_rows, "rows from which int_linear multiplies in AMX tiles (0: never)");
  m.def("tile_linear", &tile_linear,
        "bfloat16 y = x W^T on AMX tiles (or AVX-512 BF16 vectors), each row's bits the same in any batch",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("n"));
  m.def("tile_linear_available", &tile_linear_available,
        "whether tile_linear runs here (AMX bfloat16 or AVX-512 BF16)");
  m.def("tile_linear_amx", &tile_linear_amx, "whether tile_linear multiplies on AMX tiles here");
  m.def("store_kv", &store_kv, "write keys and values into their paged-pool slots (quantized into a float8 pool)",
        py::arg("k"), py::arg("v"), py::arg("kv_cache"), py::arg("slots"), py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0);
  m.def("paged_attention", &paged_attention, "paged attention reading K/V through the block table",
        py::arg("q"), py::arg("kv_cache"), py::arg("block_table"), py::arg("seq_lens"), py::arg("query_begin"),
        py::arg("query_end"), py::arg("scale"), py::arg("window"), py::arg("k_scale") = 1.0,
        py::arg("v_scale") = 1.0);
  bind_decoder_stack(m);
}
