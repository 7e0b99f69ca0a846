"""Decode steps with the layers in one C++ call (heron/model/decoder_stack.py) against the per-op layers, taking
turns in one engine, so a slow spell of a shared machine falls on both.

    python -m benchmarks.bench_decoder_stack [--model smollm2-135m-instruct --dtype float32 --batch 1,8,32]

For each batch size: ``--rounds`` rounds of ``--steps`` decode steps with the stack, then as many without it
(the order alternating by round); the median step of each, in milliseconds, and their ratio. The greedy tokens of
both are the same (tests/layers/test_decoder_stack.py holds them bit for bit).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.common import save
from heron.config import EngineConfig
from heron.engine.engine import Engine
from heron.sampling_params import RequestOutputKind, SamplingParams


def step_seconds(engine: Engine, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def measure(engine: Engine, batch: int, rounds: int, steps: int, prompt_len: int) -> dict:
    """Median decode-step milliseconds of ``batch`` sequences with and without the stack."""
    model = engine.core.runner.model
    stack = model.decoder_stack
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=2 * rounds * steps + 16, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        engine.add_request(f"{batch}-{i}", torch.randint(100, 49000, (prompt_len,), generator=g).tolist(), params)
    core = engine.core
    while core.scheduler.waiting or any(not s.is_prefill_done for s in core.scheduler.running):
        engine.step()
    step_seconds(engine, 3)  # warm
    times: dict[str, list[float]] = {"stack": [], "per_op": []}
    try:
        for r in range(rounds):
            for name in ("stack", "per_op") if r % 2 == 0 else ("per_op", "stack"):
                model.decoder_stack = stack if name == "stack" else None
                times[name] += step_seconds(engine, steps)
    finally:
        model.decoder_stack = stack
    for request_id in list(core.requests):
        engine.abort_request(request_id)
    engine.step()
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {"batch": batch, "stack_ms": ms["stack"], "per_op_ms": ms["per_op"],
            "speedup": ms["per_op"] / ms["stack"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, help="e.g. none (dense), gguf (the default for a GGUF on the CPU)")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    engine = Engine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=2048,
                                 quantization=args.quantization))
    if engine.core.runner.model.decoder_stack is None:
        raise SystemExit("this model and machine have no decoder stack (see heron/model/decoder_stack.py)")
    rows = [measure(engine, int(b), args.rounds, args.steps, args.prompt_len) for b in args.batch.split(",")]
    for r in rows:
        print(f"batch {r['batch']:>3}: stack {r['stack_ms']:6.2f} ms/step, per-op {r['per_op_ms']:6.2f} ms/step, "
              f"{r['speedup']:.2f}x")
    dtype = str(engine.core.runner.model.embed_tokens.weight.dtype).removeprefix("torch.")
    save(f"decoder_stack_{dtype}_{args.quantization or 'default'}",
         {"model": args.model, "dtype": dtype, "quantization": args.quantization, "rounds": args.rounds,
          "steps": args.steps, "prompt_len": args.prompt_len, "rows": rows})


if __name__ == "__main__":
    main()
