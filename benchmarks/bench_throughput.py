"""Offline throughput: heron's continuous batching vs transformers ``generate`` one request at a time and
with a padded static batch, on the same weights, in one run.

    python -m benchmarks.bench_throughput [--num-prompts 256 --input-len 128 --output-len 128 --static-batch 32
                                           --dtype bfloat16]

Both engines run in ``--dtype`` (bfloat16 by default: the speed issue's comparison; heron's own CPU default is
bfloat16 where the CPU computes it natively) on the same dense weights (a GGUF dequantized, for heron too unless
``--quantization gguf``).

The one-at-a-time baseline runs a subset (``--sequential-prompts``) of the requests: it processes them one
after another, so its tokens/s does not depend on how many it runs.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import load_hf_model, save
from heron import LLM, SamplingParams


def hf_generate(hf, batch: list[list[int]], output_len: int) -> int:
    x = torch.tensor(batch)
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=output_len,
                      min_new_tokens=output_len, do_sample=False, pad_token_id=0)
    return (out.shape[1] - x.shape[1]) * len(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--static-batch", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--quantization", default="none",
                    help="heron's weights (default none: the dense weights transformers runs; gguf keeps a GGUF's blocks)")
    ap.add_argument("--sequential-prompts", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    g = torch.Generator().manual_seed(args.seed)
    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    vocab = len(llm.get_tokenizer())
    prompts = torch.randint(100, vocab, (args.num_prompts, args.input_len), generator=g).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params.clone(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    heron_s = time.perf_counter() - t0
    heron_tokens = sum(len(o.outputs[0].token_ids) for o in outs)

    hf = load_hf_model(args.model, getattr(torch, args.dtype))
    hf_generate(hf, prompts[:1], 4)
    t0 = time.perf_counter()
    seq_tokens = sum(hf_generate(hf, [p], args.output_len) for p in prompts[:args.sequential_prompts])
    seq_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    static_tokens = sum(hf_generate(hf, prompts[i:i + args.static_batch], args.output_len)
                        for i in range(0, args.num_prompts, args.static_batch))
    static_s = time.perf_counter() - t0

    rates = {"heron": heron_tokens / heron_s, "hf_one_at_a_time": seq_tokens / seq_s,
             "hf_static_batch": static_tokens / static_s}
    for name, rate in rates.items():
        print(f"{name:18s} {rate:8.1f} output tok/s")
    print(f"heron vs one-at-a-time: {rates['heron'] / rates['hf_one_at_a_time']:.2f}x   "
          f"vs static batch of {args.static_batch}: {rates['heron'] / rates['hf_static_batch']:.2f}x")
    save("throughput", {"config": vars(args), "output_tok_s": rates,
                        "speedup_vs_one_at_a_time": rates["heron"] / rates["hf_one_at_a_time"],
                        "speedup_vs_static_batch": rates["heron"] / rates["hf_static_batch"],
                        "heron_stats": vars(llm.engine.stats())})


if __name__ == "__main__":
    main()
