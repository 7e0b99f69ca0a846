"""This machine's roofs for a model: how fast it could decode if it were bound only by memory (one stream) or
only by matrix arithmetic (a batch of 32), measured here, now, with the model's own weight shapes.

    python -m benchmarks.bench_roofs [--model smollm2-135m-instruct --batch 32 --name roofs]

- **Bandwidth roof (batch 1)**: a decode step must read every weight once. The read speed is the best of
  torch's ``sum`` over a buffer the size of the model's bfloat16 weights and heron's one-row kernel over the
  model's own matrices; roof tok/s = that speed / bytes per token.
- **Compute roof (batch 32)**: the model's linear layers (with the LM head) at ``--batch`` rows through the
  fastest bfloat16 matmul available (``F.linear``, oneDNN with packed weights, heron's tile matmul where it runs:
  AMX or AVX-512 BF16); roof tok/s = rows / time per pass. Attention, norms and sampling are left out, so no
  engine can reach it.

docs/performance.md divides heron's measured throughput by these.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import save
from heron.config import EngineConfig
from heron.cpu import has_native_bf16
from heron.engine.engine import Engine
from heron.kernels import cpu_kernels
from heron.quantization.base import tile_packed


def best_interleaved(fns: list, repeats: int = 5) -> list[float]:
    """The fastest of ``repeats`` timed calls of each function (after one warm-up each): the machine's
    capability, not its noise. The functions take turns, so that a slow spell of a shared machine falls on all."""
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for fn, seconds in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            seconds.append(time.perf_counter() - start)
    return [min(t) for t in times]


def best_seconds(fn, repeats: int = 5) -> float:
    """``best_interleaved`` of one function."""
    return best_interleaved([fn], repeats)[0]


def linear_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The weights every decode step multiplies: each linear layer's (the LM head included)."""
    return [m.weight for m in model.modules() if hasattr(m, "quant_method")]


def bandwidth_roof(weights: list[torch.Tensor]) -> dict:
    nbytes = sum(w.numel() * 2 for w in weights)
    buffer = torch.ones(nbytes // 4)  # float32: torch's bfloat16 sum converts element by element, not at speed
    sum_gbs = nbytes / best_seconds(buffer.sum) / 1e9
    result = {"bytes_per_token": nbytes, "sum_GBps": sum_gbs}
    kernels = cpu_kernels()
    if kernels is not None and has_native_bf16():
        bf16 = [w.to(torch.bfloat16).contiguous() for w in weights]
        rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=torch.bfloat16) for w in bf16}
        seconds = best_seconds(lambda: [kernels.gemv_bf16(rows[w.shape[1]], w, None) for w in bf16])
        result["gemv_GBps"] = nbytes / seconds / 1e9
    result["GBps"] = max(v for k, v in result.items() if k.endswith("GBps"))
    result["roof_tok_s"] = result["GBps"] * 1e9 / nbytes
    return result


def compute_roof(weights: list[torch.Tensor], batch: int) -> dict:
    flops = sum(2 * w.numel() for w in weights) * batch
    bf16 = [w.to(torch.bfloat16) for w in weights]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=torch.bfloat16) for w in bf16}
    paths = {"F.linear": [(w, lambda x, w=w: torch.nn.functional.linear(x, w)) for w in bf16]}
    if torch.backends.mkldnn.is_available():
        packed = [(w, torch.ops.mkldnn._reorder_linear_weight(w, batch)) for w in bf16]
        paths["onednn_packed"] = [(w, lambda x, p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
                                  for w, p in packed]
    tiles = [(w, tile_packed(w)) for w in bf16]
    if all(t is not None for _, t in tiles):
        kernels = cpu_kernels()
        paths["heron_tiles"] = [(w, lambda x, w=w, t=t: kernels.tile_linear(x, t, None, w.shape[0]))
                                for w, t in tiles]
    result = {"batch": batch, "gflop_per_token": flops / batch / 1e9}
    for name, calls in paths.items():
        seconds = best_seconds(lambda calls=calls: [f(inputs[w.shape[1]]) for w, f in calls])
        result[f"{name}_GFLOPs"] = flops / seconds / 1e9
    best = max(v for k, v in result.items() if k.endswith("_GFLOPs"))
    result["roof_tok_s"] = best * 1e9 / (flops / batch)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--name", default="roofs", help="the result file's name")
    args = ap.parse_args()
    # the dense weights, whatever the checkpoint's format (a GGUF would keep its blocks by default)
    engine = Engine(EngineConfig(model=args.model, dtype="bfloat16", max_model_len=512, quantization="none"))
    weights = linear_weights(engine.core.runner.model)
    result = {"model": args.model, "threads": torch.get_num_threads(),
              "bandwidth": bandwidth_roof(weights), "compute": compute_roof(weights, args.batch)}
    bw, comp = result["bandwidth"], result["compute"]
    print(f"bandwidth roof: {bw['GBps']:.1f} GB/s over {bw['bytes_per_token'] / 1e6:.0f} MB per token "
          f"-> {bw['roof_tok_s']:.0f} tok/s for one stream")
    print(f"compute roof:   {max(v for k, v in comp.items() if k.endswith('_GFLOPs')):.0f} GFLOP/s at "
          f"{args.batch} rows, {comp['gflop_per_token']:.3f} GFLOP per token -> {comp['roof_tok_s']:.0f} tok/s")
    save(args.name, result)


if __name__ == "__main__":
    main()
