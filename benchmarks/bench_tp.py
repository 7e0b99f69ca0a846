"""Decode speed at tensor-parallel size 1 and 2 on this machine, and what the all-reduces cost per step.

    python -m benchmarks.bench_tp [--write-docs] [--layers 12 --hidden 1024 ...]

The model is a random-weight Llama of SmolLM2-360M's class whose heads split in two (the default model's 9 heads
do not), loaded by ``LLM`` with one CPU thread per rank: TP=1 with 1 thread; TP=2 with 1 thread each, its
all-reduces through shared memory (the default for local ranks) and through gloo (``HERON_SHM_ALL_REDUCE=0``);
TP=1 with 2 threads (the same cores as TP=2). Prompts are 16 random token ids, ``max_tokens`` decoded per
request (``ignore_eos``), so decode dominates; tokens/s over whole ``generate`` calls, best of ``--repeats``.
The all-reduce micro-benchmark times one all-reduce of a step's ``[batch, hidden]`` activations between two
local processes, through gloo and through shared memory: a step makes two per layer (attention output, MLP
output) plus one for the embedding.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from benchmarks.bench_quant import write_docs
from benchmarks.common import save
from heron import LLM, SamplingParams
from heron.distributed.shm_all_reduce import ShmAllReduce

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import build_tiny_model  # noqa: E402

DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
DOCS_HEADING = "## Tensor parallelism"
# name: (tensor-parallel size, CPU threads per rank, shared-memory all-reduce)
RUNS = {"tp1": (1, 1, True), "tp2": (2, 1, True), "tp2_gloo": (2, 1, False), "tp1_2threads": (1, 2, True)}


def build_model(path: Path, args: argparse.Namespace) -> Path:
    return build_tiny_model("llama", path, tie_word_embeddings=True, vocab_size=args.vocab,
                            hidden_size=args.hidden, intermediate_size=args.intermediate,
                            num_hidden_layers=args.layers, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                            max_position_embeddings=1024)


def decode_rate(model: Path, tp: int, threads: int, shm: bool, batch: int, args: argparse.Namespace) -> float:
    """Output tokens/s of ``batch`` requests decoding ``args.max_tokens`` each, best of ``args.repeats``."""
    os.environ["HERON_SHM_ALL_REDUCE"] = "1" if shm else "0"
    llm = LLM(str(model), tensor_parallel_size=tp, cpu_threads=threads, dtype=args.dtype,
              enable_prefix_caching=False)
    try:
        gen = torch.Generator().manual_seed(0)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        best = 0.0
        for _ in range(args.repeats):
            prompts = [{"prompt_token_ids": torch.randint(3, args.vocab, (16,), generator=gen).tolist()}
                       for _ in range(batch)]
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            best = max(best, batch * args.max_tokens / (time.perf_counter() - start))
        return best
    finally:
        llm.engine.shutdown()


def _median_ms(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _all_reduce_rank(rank: int, port: int, shm_path: str, shapes: list[tuple[int, int]], dtype: torch.dtype,
                     reps: int, out: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    shm = ShmAllReduce(shm_path, rank, 2, timeout=60)
    for shape in shapes:
        x = torch.ones(shape, dtype=dtype)
        gloo_ms = _median_ms(lambda: dist.all_reduce(x), reps)  # noqa: B023 - called within this iteration
        shm_ms = _median_ms(lambda: shm.all_reduce(x), reps)  # noqa: B023
        if rank == 0:
            out[str(shape[0])] = {"gloo": gloo_ms, "shm": shm_ms}
    dist.destroy_process_group()


def all_reduce_ms(batches: list[int], hidden: int, dtype: torch.dtype, reps: int = 200) -> dict[str, dict]:
    """Median ms of one all-reduce of ``[batch, hidden]`` between two local processes, through gloo and
    through shared memory, per batch."""
    from heron.distributed.executor import free_port

    with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp, mp.Manager() as manager:
        path = f"{tmp}/segment"
        ShmAllReduce.create(path, 2)
        out = manager.dict()
        mp.spawn(_all_reduce_rank, args=(free_port(), path, [(b, hidden) for b in batches], dtype, reps, out),
                 nprocs=2)
        return dict(out)


def render_section(result: dict) -> str:
    m, s = result["machine"], result["settings"]
    per_step = 2 * s["layers"] + 1
    lines = [DOCS_HEADING, "", "<!-- written by `python -m benchmarks.bench_tp --write-docs`; edits here are "
             "replaced -->", "",
             f"`python -m benchmarks.bench_tp --write-docs` on {m['cpu']} ({m['cores']} vCPUs, torch {m['torch']}), "
             f"{m['date'][:10]}: a random Llama of {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads "
             f"({s['kv_heads']} KV), MLP {s['intermediate']}, vocabulary {s['vocab']} ({s['params_m']:.0f}M "
             f"parameters, {s['dtype']}); {s['max_tokens']} tokens decoded per request after a 16-token prompt, "
             f"best of {s['repeats']}; one CPU thread per rank. A step makes {per_step} all-reduces (two per layer "
             "and the embedding's).", "",
             "| batch | TP=1 | TP=2 (shm all-reduce) | TP=2 (gloo) | TP=1, 2 threads | TP=2 / TP=1 | "
             "all-reduce: gloo / shm (ms) | per step: gloo / shm (ms) |", "|---|---|---|---|---|---|---|---|"]
    for batch, row in result["batches"].items():
        r, ar = row["tokens_per_s"], row["all_reduce_ms"]
        lines.append(f"| {batch} | {r['tp1']:.1f} tok/s | {r['tp2']:.1f} | {r['tp2_gloo']:.1f} | "
                     f"{r['tp1_2threads']:.1f} | {r['tp2'] / r['tp1']:.2f}x | {ar['gloo']:.3f} / {ar['shm']:.3f} | "
                     f"{ar['gloo'] * per_step:.1f} / {ar['shm'] * per_step:.1f} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true", help=f"put the table into {DOCS}")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "model", args)
        params = sum(t.numel() for t in load_file(str(model / "model.safetensors")).values())
        reduce_ms = all_reduce_ms(batches, args.hidden, dtype)
        result = {"settings": {**vars(args), "params_m": params / 1e6}, "batches": {}}
        for batch in batches:
            rates = {name: decode_rate(model, *run, batch, args) for name, run in RUNS.items()}
            result["batches"][str(batch)] = {"tokens_per_s": rates, "all_reduce_ms": reduce_ms[str(batch)]}
            print(batch, result["batches"][str(batch)], flush=True)
    stamp = datetime.datetime.now().strftime("%H%M%S")
    saved = json.loads(save(f"tp_{stamp}", result).read_text())
    if args.write_docs:
        print(f"wrote {write_docs(render_section(saved), DOCS)}")


if __name__ == "__main__":
    main()
