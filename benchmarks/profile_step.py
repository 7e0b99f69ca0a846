"""Where an engine step's time goes: torch.profiler around ``Engine.step()`` in process, decode steps at a
given batch size, ops grouped by kind, plus the time outside the model forward. heron's C++ kernels are pybind
calls, which torch.profiler does not record: a first pass without the profiler times each of them (and the step),
a second pass under the profiler splits the PyTorch ops by kind (its own overhead inflates those). Where the
model runs its layers in one C++ call (heron/model/decoder_stack.py) that call is timed as a whole;
``--no-decoder-stack`` times the per-op layers' kernels one by one instead.

    python -m benchmarks.profile_step [--model smollm2-135m-instruct --dtype bfloat16 --batch 1,32 --steps 20]

Feeds docs/performance.md. Run it on a quiet machine: the numbers are per-step milliseconds.
"""

from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

import heron.kernels
from benchmarks.common import save
from heron.config import EngineConfig
from heron.engine.engine import Engine
from heron.sampling_params import RequestOutputKind, SamplingParams

# aten op -> kind; ops not listed count as "other ops (norms, rotary, activations, casts, views)"
KINDS = {
    "linear (matmul)": ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::mv",
                        "mkldnn::_linear_pointwise"),
    "attention: SDPA / paged kernel": ("aten::scaled_dot_product_attention",
                                       "aten::_scaled_dot_product_flash_attention_for_cpu",
                                       "aten::_scaled_dot_product_attention_math"),
    "attention: KV gather/store": ("aten::index", "aten::index_copy_", "aten::index_select"),
    "sampling": ("aten::argmax", "aten::topk", "aten::sort", "aten::log_softmax", "aten::uniform_",
                 "aten::cumsum", "aten::logsumexp"),
}


class TimedKernels:
    """heron's C++ extension (or a C++ object of it) with the seconds spent in each of its ops summed
    (``seconds``, keyed ``prefix + op``); ``seconds`` may be shared by several."""

    def __init__(self, kernels, seconds: dict[str, float], prefix: str = "") -> None:
        self._kernels = kernels
        self._prefix = prefix
        self.seconds = seconds

    def __getattr__(self, name: str):
        op = getattr(self._kernels, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return op(*args, **kwargs)
            finally:
                self.seconds[self._prefix + name] += time.perf_counter() - start
        return timed


def time_kernels(engine: Engine) -> dict[str, float] | None:
    """Route the engine's kernel calls through ``TimedKernels`` (the layers find the extension through
    ``heron.kernels.cpu_kernels``; each attention layer's backend holds it; the decoder stack its C++ object);
    the seconds they sum, or None without the extension."""
    kernels = heron.kernels.cpu_kernels()
    if kernels is None:
        return None
    seconds: dict[str, float] = defaultdict(float)
    timed = TimedKernels(kernels, seconds)
    heron.kernels.cpu_kernels = lambda: timed
    model = engine.core.runner.model
    for layer in model.attention_layers():
        if getattr(layer.backend, "kernel", None) is kernels:
            layer.backend.kernel = timed
    if model.decoder_stack is not None:
        model.decoder_stack.stack = TimedKernels(model.decoder_stack.stack, seconds, "decoder_stack.")
    return seconds


def kind_of(name: str) -> str:
    for kind, ops in KINDS.items():
        if name in ops:
            return kind
    return "other ops (norms, rotary, activations, casts, views)"


def profile_batch(engine: Engine, kernel_seconds: dict[str, float] | None, batch: int, steps: int, prompt_len: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", torch.randint(100, 49000, (prompt_len,), generator=g).tolist(), params)
    core = engine.core
    while core.scheduler.waiting or any(not s.is_prefill_done for s in core.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()  # warm
    if kernel_seconds is not None:
        kernel_seconds.clear()
    forward_before = core.runner.forward_seconds
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    forward = (core.runner.forward_seconds - forward_before) / steps * 1e3
    kernel_ms = {f"heron::{name}": s / steps * 1e3 for name, s in (kernel_seconds or {}).items()}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    by_kind: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        by_kind[kind_of(evt.key)] += evt.self_cpu_time_total / 1e3 / steps
    for request_id in list(core.requests):
        engine.abort_request(request_id)
    engine.step()
    return {"batch": batch, "step_ms": wall, "forward_ms": forward, "outside_forward_ms": wall - forward,
            "heron_kernels_ms": dict(sorted(kernel_ms.items(), key=lambda kv: -kv[1])),
            "rest_ms": wall - sum(kernel_ms.values()),
            "pytorch_ops_ms_under_profiler": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--quantization", default=None, help="e.g. none (dense), gguf (the default for a GGUF on the CPU)")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--no-decoder-stack", action="store_true",
                    help="run the layers op by op (HERON_DECODER_STACK=0), to time each kernel")
    args = ap.parse_args()
    if args.no_decoder_stack:
        os.environ["HERON_DECODER_STACK"] = "0"
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=2048,
                                 attention_backend=args.attention_backend, quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype))
    kernel_seconds = time_kernels(engine)
    rows = [profile_batch(engine, kernel_seconds, int(b), args.steps, args.prompt_len) for b in args.batch.split(",")]
    for r in rows:
        print(f"batch {r['batch']}: {r['step_ms']:.1f} ms/step (forward {r['forward_ms']:.1f}, outside "
              f"{r['outside_forward_ms']:.1f}), {r['batch'] * 1e3 / r['step_ms']:.0f} tok/s")
        for name, ms in r["heron_kernels_ms"].items():
            print(f"    {name:<55} {ms:7.2f} ms")
        print(f"    {'the rest: Python, PyTorch ops, scheduling, sampling':<55} {r['rest_ms']:7.2f} ms")
        print("  PyTorch ops under torch.profiler (inflated by its overhead):")
        for kind, ms in r["pytorch_ops_ms_under_profiler"].items():
            print(f"    {kind:<55} {ms:7.2f} ms")
    backend = engine.core.runner.backend.name
    weights = args.quantization or "default"
    layers = "per_op" if engine.core.runner.model.decoder_stack is None else "stack"
    save(f"profile_step_{args.dtype}_{weights}_{backend}_{layers}",
         {"model": args.model, "dtype": args.dtype, "quantization": args.quantization, "layers": layers,
          "kv_cache_dtype": args.kv_cache_dtype, "attention_backend": backend, "rows": rows})


if __name__ == "__main__":
    main()
