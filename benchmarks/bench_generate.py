"""Load time and single-request greedy decode speed: heron vs a plain transformers ``generate`` loop.

    python benchmarks/bench_generate.py [--model smollm2-135m-instruct] [--max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.common import load_hf_model, save
from heron import LLM, SamplingParams

PROMPT = [{"role": "user", "content": "Write a short story about a heron who learns to fish."}]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    t0 = time.perf_counter()
    llm = LLM(args.model, dtype="float32")
    heron_load = time.perf_counter() - t0
    engine = llm.engine
    ids = engine.encode(engine.apply_chat_template(PROMPT), add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    heron_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    hf = load_hf_model(args.model)
    hf_load = time.perf_counter() - t0
    x = torch.tensor([ids])
    hf.generate(x, max_new_tokens=4, do_sample=False)
    t0 = time.perf_counter()
    ref = hf.generate(x, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False)
    hf_s = time.perf_counter() - t0
    same = ref[0, len(ids):].tolist() == out.outputs[0].token_ids

    result = {
        "model": args.model, "prompt_tokens": len(ids), "output_tokens": args.max_tokens,
        "heron": {"load_s": heron_load, "decode_tok_s": args.max_tokens / heron_s},
        "transformers": {"load_s": hf_load, "decode_tok_s": args.max_tokens / hf_s},
        "speedup": hf_s / heron_s, "identical_greedy_tokens": same,
    }
    print(f"load:   heron {heron_load:.2f}s   transformers {hf_load:.2f}s")
    print(f"decode: heron {result['heron']['decode_tok_s']:.1f} tok/s   transformers "
          f"{result['transformers']['decode_tok_s']:.1f} tok/s   ratio {result['speedup']:.2f}x   "
          f"identical tokens: {same}")
    save("generate", result)


if __name__ == "__main__":
    main()
