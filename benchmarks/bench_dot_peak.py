"""This CPU's dot-product instruction rates, and how close heron's integer kernel can come to them.

    python -m benchmarks.bench_dot_peak [--threads 2 --name dot_peak]

- **Instruction peaks**: 12 independent chains of one 512-bit instruction per thread (``VPDPBUSD``: 64 int8
  multiply-adds, ``VDPBF16PS``: 32 bfloat16 ones, ``VFMADD231PS``: 16 float32 ones), on one thread and on
  ``--threads`` at once: the int8 and bfloat16 compute roofs in multiply-adds per second.
- **The integer kernel's block, in L1**: the shape of heron's VNNI loop at many rows (``int_linear.cpp``: 4
  activation rows x 2 tiles of 16 outputs, 4-bit weights split into nibbles, activations broadcast 4 bytes at a
  time, a float32 epilogue per 32 inputs: convert, scale product, two FMAs), with and without that epilogue, on
  data in L1. The epilogue's float operations share the vector pipes with ``VPDPBUSD``, so the block with it is
  the most a kernel of GGUF's Q4_1 layout (a float scale and min per 32 weights) can reach here.
- **An 8-bit layout with one scale per output row** (what a per-channel int8 copy of the weights would run):
  the same block without the nibble split, its epilogue a convert and one FMA per 32 inputs.
- **heron's kernel**: ``int_linear`` on a random 4-bit matrix of the model's MLP shape (3,072 x 576) at 512 rows,
  hot (the matrix in L2), as a fraction of the ``VPDPBUSD`` peak.

The probe is a small C++ extension built at first use (``-O3 -march=native``) and cached beside heron's kernels.
Feeds docs/performance.md (the roofs the integer path is measured against).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

from benchmarks.common import save
from heron.kernels import cpu_kernels
from heron.quantization.packed_int import IntShard, pack

PROBE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdint>
#include <cstring>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// 12 independent chains of one instruction; returns instructions per second on this thread.
template <int KIND>
double chains(int64_t iterations) {
#if defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  __m512i a[12];
  __m512 f[12];
  for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_epi32(j), f[j] = _mm512_set1_ps(1e-3f * j);
  __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x01020304);
  __m512 fx = _mm512_set1_ps(0.999f), fy = _mm512_set1_ps(1e-6f);
  asm volatile("" : "+v"(x), "+v"(y), "+v"(fx), "+v"(fy));
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) {
    for (int j = 0; j < 12; ++j) {
      if constexpr (KIND == 0) a[j] = _mm512_dpbusd_epi32(a[j], x, y);
      if constexpr (KIND == 1) f[j] = _mm512_dpbf16_ps(f[j], (__m512bh)x, (__m512bh)y);
      if constexpr (KIND == 2) f[j] = _mm512_fmadd_ps(f[j], fx, fy);
    }
  }
  const double s = seconds_since(start);
  volatile int sink = 0;
  for (int j = 0; j < 12; ++j) sink += _mm512_reduce_add_epi32(a[j]) + static_cast<int>(_mm512_reduce_add_ps(f[j]));
  return iterations * 12 / s;
#else
  return 0.0;
#endif
}

constexpr int kInputs = 512;  // 16 blocks of 32
struct BlockData {
  alignas(64) uint8_t w[2][kInputs / 8][64];  // two tiles of 4-bit weights, 64-byte steps of 8 inputs
  alignas(64) int8_t x[4][kInputs];           // four int8 activation rows
  alignas(64) float xs[4][kInputs / 32], gs[4][kInputs / 32];  // activation scales, group sums
  alignas(64) uint16_t ws[2][kInputs / 32][16], ms[2][kInputs / 32][16];  // float16 weight scales, mins
};

// One pass of heron's VNNI block (int_linear.cpp's block_dot for 4 rows x 2 tiles) over kInputs inputs.
template <bool EPILOGUE>
__attribute__((noinline)) void block_pass(const BlockData& d, __m512 (&acc)[2][4]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int kb = 0; kb < kInputs; kb += 32) {
    __m512i dot[2][4];
    for (int t = 0; t < 2; ++t)
      for (int m = 0; m < 4; ++m) dot[t][m] = _mm512_setzero_si512();
    for (int s = 0; s < 4; ++s) {
      const int k = kb + 8 * s;
      for (int t = 0; t < 2; ++t) {
        const __m512i v = _mm512_load_si512(d.w[t][k / 8]);
        const __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int m = 0; m < 4; ++m) {
          int32_t x0, x1;
          std::memcpy(&x0, d.x[m] + k, 4);
          std::memcpy(&x1, d.x[m] + k + 4, 4);
          dot[t][m] = _mm512_dpbusd_epi32(dot[t][m], lo, _mm512_set1_epi32(x0));
          dot[t][m] = _mm512_dpbusd_epi32(dot[t][m], hi, _mm512_set1_epi32(x1));
        }
      }
    }
    for (int t = 0; t < 2; ++t) {
      if constexpr (EPILOGUE) {
        const __m512 ws = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(d.ws[t][kb / 32])));
        const __m512 ms = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(d.ms[t][kb / 32])));
        for (int m = 0; m < 4; ++m) {
          const __m512 scale = _mm512_mul_ps(ws, _mm512_set1_ps(d.xs[m][kb / 32]));
          acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][m]), scale, acc[t][m]);
          acc[t][m] = _mm512_fmadd_ps(ms, _mm512_set1_ps(d.gs[m][kb / 32]), acc[t][m]);
        }
      } else {  // the integer sums kept (one add each), no float work
        for (int m = 0; m < 4; ++m) acc[t][m] = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(acc[t][m]), dot[t][m]));
      }
    }
  }
#endif
}

// The same block for 8-bit weights with one scale per output row (no per-block weight scale, no min): each
// 64-byte step is 4 inputs, and the epilogue per 32 inputs is a convert and one FMA by the activation scale.
__attribute__((noinline)) void block_pass_int8(const BlockData& d, __m512 (&acc)[2][4]) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  const uint8_t* w = &d.w[0][0][0];  // 8 KB: two tiles of 64 steps of 64 bytes, read as 8-bit codes (in turn)
  for (int kb = 0; kb < kInputs; kb += 32) {
    __m512i dot[2][4];
    for (int t = 0; t < 2; ++t)
      for (int m = 0; m < 4; ++m) dot[t][m] = _mm512_setzero_si512();
    for (int k = kb; k < kb + 32; k += 4) {
      for (int t = 0; t < 2; ++t) {
        const __m512i v = _mm512_load_si512(w + (t * 64 + k / 4 % 64) * 64);
        for (int m = 0; m < 4; ++m) {
          int32_t x0;
          std::memcpy(&x0, d.x[m] + k, 4);
          dot[t][m] = _mm512_dpbusd_epi32(dot[t][m], v, _mm512_set1_epi32(x0));
        }
      }
    }
    for (int t = 0; t < 2; ++t)
      for (int m = 0; m < 4; ++m)
        acc[t][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t][m]), _mm512_set1_ps(d.xs[m][kb / 32]), acc[t][m]);
  }
#endif
}

template <int VARIANT>  // 0: the 4-bit block with its epilogue, 1: without, 2: the per-row 8-bit block
double block_rate(int64_t passes) {
  BlockData d;
  std::memset(&d, 0x11, sizeof(d));
  __m512 acc[2][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  const auto pass = [&] {
    if constexpr (VARIANT == 0) block_pass<true>(d, acc);
    if constexpr (VARIANT == 1) block_pass<false>(d, acc);
    if constexpr (VARIANT == 2) block_pass_int8(d, acc);
  };
  for (int i = 0; i < 100; ++i) pass();
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < passes; ++i) pass();
  const double s = seconds_since(start);
  volatile float sink = _mm512_reduce_add_ps(acc[0][0]);
  (void)sink;
  return passes * (kInputs / 32) * 64.0 / s;  // VPDPBUSD per second
}

}  // namespace

// kind: 0 VPDPBUSD, 1 VDPBF16PS, 2 VFMADD231PS chains; 3 / 4 the kernel's block with / without its epilogue; 5 the
// block of 8-bit weights with a scale per output row. Returns instructions (VPDPBUSD for 3-5) per second summed over ``threads`` threads running at once.
double rate(int64_t kind, int64_t threads, int64_t iterations) {
  double total = 0.0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    switch (kind) {
      case 0: total += chains<0>(iterations); break;
      case 1: total += chains<1>(iterations); break;
      case 2: total += chains<2>(iterations); break;
      case 3: total += block_rate<0>(iterations / 100); break;
      case 4: total += block_rate<1>(iterations / 100); break;
      default: total += block_rate<2>(iterations / 100); break;
    }
  }
  return total;
}
"""

# kind -> (name, multiply-adds per instruction)
KINDS = {0: ("VPDPBUSD zmm (int8)", 64), 1: ("VDPBF16PS zmm (bfloat16)", 32), 2: ("VFMADD231PS zmm (float32)", 16),
         3: ("heron's VNNI block, with its float epilogue", 64), 4: ("heron's VNNI block, no epilogue", 64),
         5: ("8-bit weights, one scale per output row", 64)}


def build_probe():
    from heron.model.default_model import heron_cache_dir

    directory = heron_cache_dir() / "kernels" / "dot_peak"
    directory.mkdir(parents=True, exist_ok=True)
    return load_inline("heron_dot_peak", cpp_sources=PROBE, functions=["rate"], build_directory=str(directory),
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])


def kernel_fraction(peak_macs: float, rows: int = 512) -> dict:
    """heron's int_linear on a random 4-bit 3,072 x 576 matrix at ``rows`` rows, hot: multiply-adds per second."""
    kernels = cpu_kernels()
    if kernels is None:
        return {}
    g = torch.Generator().manual_seed(0)
    n, k = 3072, 576
    packed = pack(IntShard(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                           torch.rand(n, k // 32, generator=g).half().float(),
                           torch.rand(n, k // 32, generator=g).half().float(), 4, 32))
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    best = float("inf")
    for _ in range(20):
        start = time.perf_counter()
        kernels.int_linear(x, packed.qweight, packed.scales, packed.mins, packed.bits, packed.group, packed.n, None)
        best = min(best, time.perf_counter() - start)
    macs = rows * n * k / best
    return {"rows": rows, "shape": [n, k], "GMACs": macs / 1e9, "of_vpdpbusd_peak": macs / peak_macs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iterations", type=int, default=20_000_000, help="chain iterations per measurement")
    ap.add_argument("--name", default="dot_peak", help="the result file's name")
    args = ap.parse_args()
    probe = build_probe()
    rows = []
    for kind, (name, macs) in KINDS.items():
        one = max(probe.rate(kind, 1, args.iterations) for _ in range(3))
        every = max(probe.rate(kind, args.threads, args.iterations) for _ in range(3))
        rows.append({"instruction": name, "per_thread_G": one / 1e9, "all_threads_G": every / 1e9,
                     "GMACs": every * macs / 1e9})
        print(f"{name:<46} {one / 1e9:5.2f} G/s a thread, {every / 1e9:5.2f} G/s on {args.threads} "
              f"({every * macs / 1e9:6.0f} G multiply-adds/s)")
    if rows[0]["all_threads_G"] == 0:
        print("this CPU has no AVX-512 VNNI and BF16: no peaks measured")
    peak = rows[0]["GMACs"] * 1e9
    for row in rows[3:]:
        row["of_vpdpbusd_peak"] = row["all_threads_G"] / rows[0]["all_threads_G"] if peak else None
    kernel = kernel_fraction(peak) if peak else {}
    for row in rows[3:]:
        print(f"{row['instruction']:<46} {row['of_vpdpbusd_peak']:.0%} of the VPDPBUSD peak")
    if kernel:
        print(f"heron's int_linear, {kernel['shape'][0]} x {kernel['shape'][1]} at {kernel['rows']} rows, hot: "
              f"{kernel['GMACs']:.0f} G multiply-adds/s, {kernel['of_vpdpbusd_peak']:.0%} of the VPDPBUSD peak")
    save(args.name, {"threads": args.threads, "instructions": rows, "int_linear": kernel})


if __name__ == "__main__":
    main()
