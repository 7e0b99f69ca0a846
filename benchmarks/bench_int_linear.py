"""heron's integer-weight matmul against the dense paths, at each number of rows, on the default model's own
linear layers (every layer of the model, so the weights come from memory as in a decode step):

    python -m benchmarks.bench_int_linear [--model smollm2-135m-instruct --rows 1,2,4,8,12,16,32,64]

For each row count: the model's GGUF blocks through heron's int8-dot kernel (Q4_1 layers, Q8_0 LM head), the
same weights requantized to 8 bits, and the dense weights in heron's default dtype for this CPU (bfloat16 where
it is native, else float32; ``--dtype``) through the path heron takes for them (bfloat16: its one-row kernel up
to 4 rows, oneDNN's packed GEMM above): where the integer kernel gains (memory-bound small batches) and where
it loses to the dense GEMM (e.g. AMX bfloat16 tiles against AVX-512 VNNI int8 dots). Results go to
``benchmarks/results/int_linear_<kernel ISA>.json``.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.bench_roofs import best_seconds
from benchmarks.common import save
from heron.engine.memory import resolve_dtype
from heron.kernels import load_cpu_kernels
from heron.layers.linear import LinearBase
from heron.model.loader import load_model
from heron.quantization.base import dense_linear, onednn_packed
from heron.quantization.packed_int import IntShard, PackedInt, integer_kernel, pack, unpack


def as_8bit(packed: PackedInt) -> PackedInt:
    """The same weight in 8-bit lanes (what Q8_0 / int8 layers read)."""
    shard = unpack(packed)
    return pack(IntShard(shard.q, shard.scales, shard.mins, 8, shard.group))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,2,4,8,12,16,24,32,64")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="auto", help="the dense path's dtype (auto: heron's default here)")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    model = load_model(args.model, dtype, torch.device("cpu")).model
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and getattr(m, "packed", None) is not None]
    packed = [m.packed for m in layers]
    packed8 = [as_8bit(p) if p.bits == 4 else p for p in packed]
    dense = [p.dequantize(dtype) for p in packed]
    onednn = [onednn_packed(w) for w in dense]
    def integer(weights: list[PackedInt], xs: dict[int, torch.Tensor]) -> None:
        for p in weights:
            kernels.int_linear(xs[p.k], p.qweight, p.scales, p.mins, p.bits, p.group, p.n, None)

    def dense_path(xs: dict[int, torch.Tensor]) -> None:
        for w, o in zip(dense, onednn, strict=True):
            dense_linear(xs[w.shape[1]], w, o, None)

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
    weights = {"gguf_mib": sum(p.nbytes for p in packed) / 2**20,
               "int8_mib": sum(p.nbytes for p in packed8) / 2**20,
               "dense_mib": sum(w.nbytes for w in dense) / 2**20}
    kernel = integer_kernel()
    isa = kernel[kernel.find("(") + 1:].split(")")[0].split(":")[0].replace(" ", "_").lower()
    save(f"int_linear_{isa}", {"model": args.model, "layers": len(layers), "kernel": kernel,
                               "dense_dtype": str(dtype), "weights": weights, "results": results})


if __name__ == "__main__":
    main()
