"""Engine time per step outside the model forward, at batch 32, with short vs long contexts.

    python -m benchmarks.bench_step_overhead [--batch 32 --contexts 128,2048 --steps 40]

Everything an engine step does besides ``model.forward`` (scheduling, block bookkeeping and prefix hashing,
input building, attention-metadata preparation, the LM head and sampling, stop checks, detokenization,
output assembly) must grow with the batch and the new tokens, not with the context: the ratio between the
two contexts should stay near 1. Measured for greedy decoding and for top-p sampling (whose vocabulary-wide
work dominates a step on a random model's flat distributions). The model is a small random Llama with SmolLM2's vocabulary (49,152), so the
forward is cheap and the LM head and sampler cost what they cost on the real model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import save
from heron.config import EngineConfig
from heron.engine.engine import Engine
from heron.sampling_params import RequestOutputKind, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import build_tiny_model  # noqa: E402

MODES = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=0.8, top_p=0.95)}


def measure(model_dir: Path, batch: int, context: int, steps: int, seed: int, mode: str) -> dict:
    """Median per-step time, in and outside the forward, over ``steps`` decode steps at ``context`` tokens."""
    # room for the tokens decoded while later prompts still prefill, then ``steps`` measured ones
    max_tokens = steps + batch * context // 4096 + 8
    engine = Engine(EngineConfig(model=str(model_dir), max_model_len=context + max_tokens + 1, max_num_seqs=batch,
                                 kv_cache_memory=str(batch * (context + max_tokens + 16) * 1024),
                                 max_num_batched_tokens=4096))
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(**MODES[mode], seed=seed, max_tokens=max_tokens, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    for i in range(batch):
        engine.add_request(str(i), torch.randint(3, 49152, (context,), generator=g).tolist(), params)
    runner = engine.core.runner
    while engine.core.scheduler.waiting or any(not s.is_prefill_done for s in engine.core.scheduler.running):
        engine.step()
    totals, outside = [], []
    for _ in range(steps):
        forward_before = runner.forward_seconds
        start = time.perf_counter()
        engine.step()
        total = time.perf_counter() - start
        totals.append(total)
        outside.append(total - (runner.forward_seconds - forward_before))
    assert len(engine.core.scheduler.running) == batch
    return {"mode": mode, "context": context, "batch": batch, "steps": steps,
            "step_ms": statistics.median(totals) * 1e3, "outside_forward_ms": statistics.median(outside) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--contexts", default="128,2048")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model("llama", tmp, vocab_size=49152, max_position_embeddings=8192)
        rows = [measure(model_dir, args.batch, c, args.steps, args.seed, mode) for mode in MODES for c in contexts]
    ratios = {}
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        for r in mine:
            print(f"{mode:>6} context {r['context']:>6}: step {r['step_ms']:7.2f} ms, "
                  f"outside the forward {r['outside_forward_ms']:6.2f} ms")
        ratios[mode] = mine[-1]["outside_forward_ms"] / mine[0]["outside_forward_ms"]
        print(f"{mode:>6} outside-forward ratio {contexts[-1]} vs {contexts[0]}: {ratios[mode]:.2f}")
    save("step_overhead", {"rows": rows, "ratios": ratios})


if __name__ == "__main__":
    main()
