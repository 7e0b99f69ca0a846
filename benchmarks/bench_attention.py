"""heron's CPU paged-attention kernel on the default model's attention shape (9 query heads, 3 KV heads, head
dim 64, blocks of 16), one layer's call, for the steps a server makes:

    python -m benchmarks.bench_attention [--dtype auto --kv-cache-dtype auto --threads 1,2 --layers 1
                                          --name attention]

decode of 1 and of 32 sequences, a verification step (5 queries over a context), prefill chunks over a cached
prefix. Blocks are scattered over a pool larger than the caches, as a server's are. With ``--layers 30`` each
call is one of a step's 30 layers, each with its own pool, so the keys and values come from memory as a served
step's do (one layer's pool stays in the L3 cache). The best of a few timed runs per shape (the machine's
capability, not its noise); results go to ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from benchmarks.bench_roofs import best_seconds
from benchmarks.common import save
from heron.engine.memory import resolve_dtype
from heron.kernels import load_cpu_kernels
from heron.quantization.kv import FP8_KV_CACHE_DTYPES

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
# name -> (sequences, context length, new queries per sequence)
STEPS = {
    "decode, 1 sequence, 256 positions": (1, 256, 1),
    "decode, 1 sequence, 1024 positions": (1, 1024, 1),
    "decode, 32 sequences, 192 positions": (32, 192, 1),
    "verification, 5 queries, 256 positions": (1, 256, 5),
    "prefill chunks, 4 x 128 queries, 512 positions": (4, 512, 128),
}


def attention_call(kernels, sequences: int, context: int, queries: int, dtype: torch.dtype,
                   pool_dtype: torch.dtype, layers: int = 1):
    """A step's kernel calls, one per layer, each over ``sequences`` caches of ``context`` positions in scattered
    blocks of the layer's own pool (of ``pool_dtype``: ``dtype``, or float8)."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    q = torch.randn(sequences * queries, HEADS, HEAD_DIM, generator=g).to(dtype)
    lens = torch.full((sequences,), context, dtype=torch.int32)
    begin = torch.arange(sequences, dtype=torch.int32) * queries
    calls = []
    for _ in range(layers):
        pool = torch.randn(2, 2 * sequences * per_seq, KV_HEADS, BLOCK, HEAD_DIM, generator=g).to(pool_dtype)
        blocks = torch.randperm(pool.shape[1], generator=g)[: sequences * per_seq]
        table = blocks.view(sequences, per_seq).to(torch.int32)
        calls.append(partial(kernels.paged_attention, q, pool, table, lens, begin, begin + queries, HEAD_DIM**-0.5,
                             0))

    def step() -> None:
        for call in calls:
            call()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", help="queries and pool (auto: heron's default here)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *FP8_KV_CACHE_DTYPES],
                        help="the pool's dtype (auto: the queries')")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layers", type=int, default=1,
                        help="layers of a step, each with its own pool, called in turn (30: the pools come from "
                             "memory, as a served step's do; 1: they stay in the cache)")
    parser.add_argument("--name", default="attention", help="the result file's name")
    args = parser.parse_args()
    kernels = load_cpu_kernels()
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    pool_dtype = dtype if args.kv_cache_dtype == "auto" else getattr(torch, FP8_KV_CACHE_DTYPES[args.kv_cache_dtype])
    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name, (sequences, context, queries) in STEPS.items():
            step = attention_call(kernels, sequences, context, queries, dtype, pool_dtype, args.layers)
            calls = max(1, int(20_000 // (sequences * context * queries) ** 0.5 / args.layers))

            def timed(step=step, calls=calls) -> None:
                for _ in range(calls):
                    step()

            us = best_seconds(timed, args.repeats) / (calls * args.layers) * 1e6
            results.append({"step": name, "threads": threads, "us_per_call": us})
            print(f"{threads} threads  {name:48s} {us:9.1f} us", flush=True)
    save(args.name, {"dtype": str(dtype), "kv_cache_dtype": str(pool_dtype), "heads": HEADS, "kv_heads": KV_HEADS,
                     "head_dim": HEAD_DIM, "block_size": BLOCK, "layers": args.layers, "results": results})


if __name__ == "__main__":
    main()
