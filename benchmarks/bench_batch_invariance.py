"""Does a request's greedy output depend on its batch? The plain engine on the default model, each prompt of
``benchmarks/bench_spec.py``'s two tasks one at a time and then in batches; counts the completions that differ.

    python -m benchmarks.bench_batch_invariance [--enable-prefix-caching] [--max-num-batched-tokens N]

With ``--enable-prefix-caching`` the batched runs find each prompt cached by its run alone (all but its last
block is read from the cache, the rest computed), and a token budget cuts prompts into other chunks.
"""

from __future__ import annotations

import argparse

from benchmarks.bench_spec import chat_prompts, grounded_prompts
from benchmarks.common import save


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch-sizes", default="8,32")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="off (default): every prompt computed in full, alone or batched")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="the step's token budget")
    parser.add_argument("--name", default="batch_invariance", help="the result file's name")
    args = parser.parse_args()
    from heron import LLM, SamplingParams

    budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    llm = LLM(args.model, enable_prefix_caching=args.enable_prefix_caching, **budget)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    result = {"settings": vars(args), "tasks": {}}
    for task, prompts in (("chat", chat_prompts), ("grounded", grounded_prompts)):
        convs = prompts(args.num_prompts)
        alone = [llm.chat([c], params, use_tqdm=False)[0].outputs[0].token_ids for c in convs]
        result["tasks"][task] = {}
        for size in map(int, args.batch_sizes.split(",")):
            batched = []
            for i in range(0, len(convs), size):
                batched += [o.outputs[0].token_ids for o in llm.chat(convs[i:i + size], params, use_tqdm=False)]
            differ = sum(a != b for a, b in zip(alone, batched, strict=True))
            result["tasks"][task][str(size)] = {"differ": differ, "of": len(convs)}
            print(f"{task}, batches of {size}: {differ} of {len(convs)} completions differ from one at a time")
    save(args.name, result)


if __name__ == "__main__":
    main()
