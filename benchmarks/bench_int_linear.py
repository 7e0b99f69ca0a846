"""heron's integer-weight matmul against the dense paths, at each number of rows, on the default model's own
linear layers (every layer of the model, so the weights come from memory as in a decode step):

    python -m benchmarks.bench_int_linear [--model smollm2-135m-instruct --rows 1,2,4,8,12,16,32,64]
    python -m benchmarks.bench_int_linear --by-size    # one row's GB/s from memory, by matrix size

For each row count: the model's GGUF blocks through heron's int8-dot kernel (Q4_1 layers, Q8_0 LM head), the
same weights requantized to 8 bits, and the dense weights in heron's default dtype for this CPU (bfloat16 where
it is native, else float32; ``--dtype``) through the path heron takes for them (bfloat16: its one-row kernel up
to 4 rows, above its tile matmul where it runs (AMX or AVX-512 BF16), else oneDNN's packed GEMM): where the
integer kernel gains (memory-bound small batches) and where it loses to the dense GEMM (e.g. AMX bfloat16 tiles against AVX-512 VNNI int8 dots). Results go to
``benchmarks/results/int_linear_<kernel ISA>.json`` (or ``--name``).
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import load

from benchmarks.bench_roofs import best_interleaved, best_seconds
from benchmarks.common import save
from heron.engine.memory import resolve_dtype
from heron.kernels import _CFLAGS, load_cpu_kernels
from heron.layers.linear import LinearBase
from heron.model.loader import load_model
from heron.quantization.base import batch_packed, dense_linear
from heron.quantization.packed_int import IntShard, PackedInt, integer_kernel, pack, unpack


def as_8bit(packed: PackedInt) -> PackedInt:
    """The same weight in 8-bit lanes (what Q8_0 / int8 layers read)."""
    shard = unpack(packed)
    return pack(IntShard(shard.q, shard.scales, shard.mins, 8, shard.group))


def baseline_kernels(rev: str) -> ModuleType:
    """heron's ``int_linear`` as it was at git revision ``rev``, built beside today's (to compare in one run)."""
    root = Path(__file__).resolve().parents[1]
    build = Path(tempfile.mkdtemp(prefix="heron-int-linear-"))
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout

    headers = [Path(p).name for p in git("ls-tree", "--name-only", rev, "heron/kernels/csrc/").split()
               if p.endswith(".h")]
    for name in ["int_linear.cpp", *headers]:
        (build / name).write_text(git("show", f"{rev}:heron/kernels/csrc/{name}"))
    with open(build / "int_linear.cpp", "a") as f:
        f.write('\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("int_linear", &int_linear); }\n')
    return load(name="heron_int_linear_baseline", sources=[str(build / "int_linear.cpp")], build_directory=str(build),
                extra_include_paths=[str(build)], extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"])


def by_size(kernels: ModuleType, repeats: int) -> list[dict]:
    """One row's read speed of the integer kernel, from memory, for matrices of the model's shapes and larger:
    each shape is repeated until the copies (~70+ MiB) are past the L3, and the row goes through all of them."""
    results = []
    for n, k, count in [(49_152, 576, 6), (3_072, 576, 60), (576, 1_536, 120), (576, 576, 300)]:
        g = torch.Generator().manual_seed(n)
        weights = [pack(IntShard(torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g),
                                 torch.rand(n, k // 32, generator=g), torch.rand(n, k // 32, generator=g), 4, 32))
                   for _ in range(count)]
        x = torch.randn(1, k, generator=g).bfloat16()
        nbytes = sum(p.nbytes for p in weights)

        def run(weights: list[PackedInt] = weights, x: torch.Tensor = x) -> None:
            for p in weights:
                kernels.int_linear(x, p.qweight, p.scales, p.mins, p.bits, p.group, p.n, None)

        seconds = best_seconds(run, repeats)
        row = {"n": n, "k": k, "matrix_mib": nbytes / count / 2**20, "copies": count,
               "us_per_call": seconds / count * 1e6, "gb_per_s": nbytes / seconds / 1e9}
        results.append(row)
        print(f"{n:6d} x {k:5d} ({row['matrix_mib']:6.2f} MiB) x {count:3d}: {row['us_per_call']:7.1f} us a call, "
              f"{row['gb_per_s']:5.1f} GB/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,2,4,8,12,16,24,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto", help="the dense path's dtype (auto: heron's default here)")
    parser.add_argument("--baseline", default=None, metavar="REV",
                        help="also time the kernel of git revision REV, taking turns with today's")
    parser.add_argument("--name", default=None, help="the result file's name (default: int_linear_<kernel ISA>)")
    parser.add_argument("--by-size", action="store_true",
                        help="instead: one bfloat16 row through random 4-bit matrices of several sizes, each shape "
                             "repeated past the L3 so that it comes from memory (GB/s per size)")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    if args.by_size:
        save(args.name or "int_linear_by_size", {"kernel": integer_kernel(), "results": by_size(kernels, args.repeats)})
        return
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = load_model(args.model, dtype, torch.device("cpu")).model
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and getattr(m, "packed", None) is not None]
    packed = [m.packed for m in layers]
    packed8 = [as_8bit(p) if p.bits == 4 else p for p in packed]
    dense = [p.dequantize(dtype) for p in packed]
    for_many_rows = [batch_packed(w) for w in dense]
    baseline = baseline_kernels(args.baseline) if args.baseline else None

    def integer(weights: list[PackedInt], xs: dict[int, torch.Tensor], kernels: ModuleType = kernels) -> None:
        for p in weights:
            kernels.int_linear(xs[p.k], p.qweight, p.scales, p.mins, p.bits, p.group, p.n, None)

    def dense_path(xs: dict[int, torch.Tensor]) -> None:
        for w, b in zip(dense, for_many_rows, strict=True):
            dense_linear(xs[w.shape[1]], w, b, None)

    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {p.k: torch.randn(rows, p.k, dtype=dtype) for p in packed}
        row = {"rows": rows, "gguf_ms": best_seconds(partial(integer, packed, xs), args.repeats) * 1e3,
               "int8_ms": best_seconds(partial(integer, packed8, xs), args.repeats) * 1e3,
               "dense_ms": best_seconds(partial(dense_path, xs), args.repeats) * 1e3}
        row["gguf_speedup"] = row["dense_ms"] / row["gguf_ms"]
        row["int8_speedup"] = row["dense_ms"] / row["int8_ms"]
        results.append(row)
        print(f"{rows:4d} rows: gguf {row['gguf_ms']:7.2f} ms  int8 {row['int8_ms']:7.2f} ms  "
              f"{dtype} {row['dense_ms']:7.2f} ms  gguf speedup {row['gguf_speedup']:.2f}x  "
              f"int8 {row['int8_speedup']:.2f}x", flush=True)
        if baseline is not None:
            fns = [partial(integer, w, xs, k) for w in (packed, packed8) for k in (kernels, baseline)]
            gguf, gguf_base, int8, int8_base = (t * 1e3 for t in best_interleaved(fns, args.repeats))
            row["against_baseline"] = {"rev": args.baseline, "gguf_ms": gguf, "baseline_gguf_ms": gguf_base,
                                       "int8_ms": int8, "baseline_int8_ms": int8_base}
            print(f"      against {args.baseline}, taking turns: gguf {gguf_base:.2f} -> {gguf:.2f} ms "
                  f"({gguf_base / gguf:.2f}x), int8 {int8_base:.2f} -> {int8:.2f} ms ({int8_base / int8:.2f}x)")
    weights = {"gguf_mib": sum(p.nbytes for p in packed) / 2**20,
               "int8_mib": sum(p.nbytes for p in packed8) / 2**20,
               "dense_mib": sum(w.nbytes for w in dense) / 2**20}
    kernel = integer_kernel()
    isa = kernel[kernel.find("(") + 1:].split(")")[0].split(":")[0].split(";")[0].replace(" ", "_").lower()
    isa += "_amx" if "AMX" in kernel else ""
    save(args.name or f"int_linear_{isa}", {"model": args.model, "layers": len(layers), "kernel": kernel,
                               "dense_dtype": str(dtype), "weights": weights, "results": results})


if __name__ == "__main__":
    main()
