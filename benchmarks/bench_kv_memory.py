"""KV-cache memory: the share of reserved KV memory that holds live tokens, heron's paged pool vs a
contiguous cache pre-allocated to max-model-len per request (what naive serving does), and how many requests
each fits at once in the same memory. Both are measured over the same run, step by step.

    python benchmarks/bench_kv_memory.py [--model smollm2-135m-instruct --num-prompts 64 --naive-slots 8]

heron gets exactly the memory that ``--naive-slots`` contiguous max-model-len buffers would take.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import save
from heron import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--naive-slots", type=int, default=8, help="requests a contiguous cache would hold")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    budget_tokens = args.naive_slots * args.max_model_len
    llm = LLM(args.model, max_model_len=args.max_model_len, block_size=args.block_size,
              num_gpu_blocks_override=budget_tokens // args.block_size, enable_prefix_caching=False)
    engine = llm.engine
    g = torch.Generator().manual_seed(args.seed)
    vocab = len(llm.get_tokenizer())
    for i in range(args.num_prompts):
        prompt_len = int(torch.randint(32, 513, (1,), generator=g))
        out_len = int(torch.randint(16, 257, (1,), generator=g))
        prompt = torch.randint(100, vocab, (prompt_len,), generator=g).tolist()
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))

    live_sum = heron_reserved_sum = naive_reserved_sum = 0
    peak_running, steps = 0, 0
    bm = engine.core.block_manager
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.core.scheduler.running
        live = sum(s.num_computed_tokens for s in running)
        live_sum += live
        heron_reserved_sum += (bm.num_blocks - bm.num_free_blocks) * args.block_size
        naive_reserved_sum += len(running) * args.max_model_len
        peak_running = max(peak_running, len(running))
        steps += 1
    heron_waste = 1 - live_sum / heron_reserved_sum
    naive_waste = 1 - live_sum / naive_reserved_sum
    stats = engine.stats()
    print(f"KV budget: {budget_tokens} tokens ({args.naive_slots} x max_model_len {args.max_model_len})")
    print(f"reserved KV memory not holding live tokens: heron {heron_waste:.1%}   contiguous {naive_waste:.1%}")
    print(f"requests at once in the same memory: heron {peak_running} (peak)   contiguous {args.naive_slots}")
    print(f"preemptions: {stats.num_preemptions}   steps: {steps}")
    save("kv_memory", {"config": vars(args), "heron_waste": heron_waste, "contiguous_waste": naive_waste,
                       "heron_peak_concurrent": peak_running, "contiguous_concurrent": args.naive_slots,
                       "preemptions": stats.num_preemptions, "steps": steps})


if __name__ == "__main__":
    main()
