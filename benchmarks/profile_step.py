"""Where an engine step's time goes: torch.profiler around ``Engine.step()`` in process, decode steps at a
given batch size, ops grouped by kind, plus the time outside the model forward.

    python -m benchmarks.profile_step [--model smollm2-135m-instruct --dtype bfloat16 --batch 1,32 --steps 20]

Feeds docs/performance.md. Run it on a quiet machine: the numbers are per-step milliseconds.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

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


def kind_of(name: str) -> str:
    for kind, ops in KINDS.items():
        if name in ops:
            return kind
    return "other ops (norms, rotary, activations, casts, views)"


def profile_batch(engine: Engine, batch: int, steps: int, prompt_len: int) -> dict:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", torch.randint(100, 49000, (prompt_len,), generator=g).tolist(), params)
    core = engine.core
    while core.scheduler.waiting or any(not s.is_prefill_done for s in core.scheduler.running):
        engine.step()
    for _ in range(3):
        engine.step()  # warm
    forward_before = core.runner.forward_seconds
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    wall = (time.perf_counter() - start) / steps * 1e3
    forward = (core.runner.forward_seconds - forward_before) / steps * 1e3
    by_kind: dict[str, float] = defaultdict(float)
    for evt in prof.key_averages():
        by_kind[kind_of(evt.key)] += evt.self_cpu_time_total / 1e3 / steps
    # heron's C++ kernels are pybind calls, which torch.profiler does not record: they (and Python) are the rest
    by_kind["not seen by the profiler: heron's C++ kernels (GEMV, attention, fused ops), Python"] = \
        wall - sum(by_kind.values())
    for request_id in list(core.requests):
        engine.abort_request(request_id)
    engine.step()
    return {"batch": batch, "step_ms": wall, "forward_ms": forward, "outside_forward_ms": wall - forward,
            "ops_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1]))}


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
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=2048,
                                 attention_backend=args.attention_backend, quantization=args.quantization,
                                 kv_cache_dtype=args.kv_cache_dtype))
    rows = [profile_batch(engine, int(b), args.steps, args.prompt_len) for b in args.batch.split(",")]
    for r in rows:
        print(f"batch {r['batch']}: {r['step_ms']:.1f} ms/step (forward {r['forward_ms']:.1f}, outside "
              f"{r['outside_forward_ms']:.1f}), {r['batch'] * 1e3 / r['step_ms']:.0f} tok/s")
        for kind, ms in r["ops_ms"].items():
            print(f"    {kind:<55} {ms:7.2f} ms")
    backend = engine.core.runner.backend.name
    weights = args.quantization or "default"
    save(f"profile_step_{args.dtype}_{weights}_{backend}",
         {"model": args.model, "dtype": args.dtype, "quantization": args.quantization,
          "kv_cache_dtype": args.kv_cache_dtype, "attention_backend": backend, "rows": rows})


if __name__ == "__main__":
    main()
