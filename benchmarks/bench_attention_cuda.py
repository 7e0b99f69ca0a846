"""Attention backends on a GPU: the reference backend (gather + SDPA) against the Triton paged kernel, one
layer's call (keys and values of the new tokens stored, then attended) on the default model's attention shape,
for the steps of ``bench_attention`` (decodes, verification, prefill chunks over a cached prefix):

    python -m benchmarks.bench_attention_cuda [--dtype bfloat16 --backends reference,triton_paged]

Each backend's output is checked against the reference's first; results go to
``benchmarks/results/<name>.json``. Needs CUDA and Triton (``benchmarks/gpu_check.sh`` runs it).
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench_attention import BLOCK, HEAD_DIM, HEADS, KV_HEADS, STEPS
from benchmarks.common import save
from heron.attention.backend import AttentionMetadata, get_attention_backend


def step_inputs(sequences: int, context: int, queries: int, dtype: torch.dtype, device: torch.device):
    """Queries, new keys/values, a pool with ``context - queries`` cached positions per sequence in scattered
    blocks, and the step's metadata."""
    g = torch.Generator().manual_seed(0)
    per_seq = -(-context // BLOCK)
    pool = torch.randn(2, 2 * sequences * per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    table = torch.randperm(pool.shape[1], generator=g)[: sequences * per_seq].view(sequences, per_seq)
    q = torch.randn(sequences * queries, HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(sequences * queries, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    pos = torch.arange(context - queries, context)
    slots = (table[:, pos // BLOCK] * BLOCK + pos % BLOCK).flatten()
    meta = AttentionMetadata(
        query_start_loc=torch.arange(sequences + 1, dtype=torch.int32, device=device) * queries,
        seq_lens=torch.full((sequences,), context, dtype=torch.int32, device=device),
        block_table=table.to(torch.int32).to(device), slot_mapping=slots.to(device),
        query_lens=[queries] * sequences, context_lens=[context] * sequences, block_size=BLOCK)
    return q.to(device), k.to(device), v.to(device), pool.to(device), meta


def time_call(call, repeats: int) -> float:
    """Median microseconds of ``call`` over ``repeats`` timed runs of 20 calls each (CUDA events)."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 20)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backends", default="reference,triton_paged")
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--name", default="attention_cuda", help="the result file's name")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    names = args.backends.split(",")
    results = []
    for step, (sequences, context, queries) in STEPS.items():
        outputs = {}
        for name in names:
            backend = get_attention_backend(name, device)
            q, k, v, pool, meta = step_inputs(sequences, context, queries, dtype, device)
            backend.prepare(meta)
            outputs[name] = backend.forward(q, k, v, pool, meta).float()
            us = time_call(lambda b=backend, q=q, k=k, v=v, pool=pool, meta=meta: b.forward(q, k, v, pool, meta),
                           args.repeats)
            error = (outputs[name] - outputs[names[0]]).abs().max().item()
            results.append({"step": step, "backend": name, "us_per_call": us, "max_abs_diff_to_first": error})
            print(f"{name:14s} {step:48s} {us:9.1f} us  (max |diff| to {names[0]}: {error:.2e})", flush=True)
    save(args.name, {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "heads": HEADS,
                     "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "block_size": BLOCK, "results": results})


if __name__ == "__main__":
    main()
