"""Sampler cost per step at batch 64 over SmolLM2's 49152-token vocabulary, and structured-output throughput.

    python -m benchmarks.bench_sampler [--batch 64] [--steps 20] [--threads N]

Part 1 times one ``Sampler`` call (random logits) for: greedy; plain temperature sampling; every option on
(temperature, top-k, top-p, min-p, three penalties over a 512-token prompt and 128 outputs, logit_bias,
allowed_token_ids, bad_words, min_tokens, per-row seeds, 5 logprobs); and top-p without top-k (the full-sort
path). Part 2 samples ``--steps`` tokens for 64 rows with a JSON-schema grammar (mask fill, masking, sampling
and ``accept_token``; a finished document restarts its row) against the same rows unconstrained, with
SmolLM2's real tokenizer.
Results go to benchmarks/results/sampler.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import save
from heron.sampling.sampler import Sampler, SamplingRow
from heron.sampling_params import GuidedDecodingParams, SamplingParams

VOCAB = 49152
EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "species": {"type": "string", "enum": ["grey heron", "great egret", "little bittern"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 60},
        "weight_kg": {"type": "number"},
        "sightings": {"type": "array", "maxItems": 4, "items": {
            "type": "object",
            "properties": {"place": {"type": "string", "maxLength": 16}, "count": {"type": "integer"}},
            "required": ["place", "count"]}},
    },
    "required": ["name", "species", "age", "sightings"],
}


def time_steps(fn: Callable[[], object], steps: int, warmup: int = 2) -> float:
    """Median seconds of one ``fn()`` call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def overhead(batch: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, VOCAB, generator=g) * 3
    prompt = torch.randint(3, VOCAB, (512,), generator=g).tolist()
    output = torch.randint(3, VOCAB, (128,), generator=g).tolist()
    all_on = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.3, logit_bias={i: 1.0 for i in range(10)},
                            allowed_token_ids=list(range(0, VOCAB, 2)), min_tokens=200, max_tokens=256,
                            logprobs=5, seed=0)
    all_on.bad_words_token_ids = [[100], [output[-1], 202]]
    cases = {
        "greedy": SamplingParams(temperature=0),
        "temperature_only": SamplingParams(temperature=0.8),
        "all_options": all_on,
        "top_p_only": SamplingParams(temperature=0.8, top_p=0.9),
    }
    sampler = Sampler(VOCAB, [EOS])
    result = {}
    for name, params in cases.items():
        def step(params=params):
            gens = [torch.Generator().manual_seed(i) if params.seed is not None else None for i in range(batch)]
            rows = [SamplingRow(params, prompt, output, gens[i]) for i in range(batch)]
            return sampler(logits, rows)
        result[name] = time_steps(step, steps) * 1e3
        print(f"  {name:18s} {result[name]:8.2f} ms/step")
    return {"batch": batch, "vocab": VOCAB, "ms_per_step": result,
            "all_options_vs_greedy": result["all_options"] / result["greedy"]}


def smollm2_tokenizer():
    from heron.bench.resolve import load_tokenizer

    return load_tokenizer("smollm2-135m-instruct")


def structured(batch: int, steps: int) -> dict:
    from heron.sampling.structured import StructuredOutputCompiler

    tokenizer = smollm2_tokenizer()
    t0 = time.perf_counter()
    compiler = StructuredOutputCompiler(tokenizer, VOCAB, [EOS])
    setup_s = time.perf_counter() - t0
    # random logits would spend most steps in free JSON whitespace; compact JSON walks through whole documents
    guided = GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)
    t0 = time.perf_counter()
    compiler.compile(guided)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(guided)
    cached_s = time.perf_counter() - t0
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(VOCAB, [EOS])
    g = torch.Generator().manual_seed(1)
    logits = [torch.randn(batch, VOCAB, generator=g) * 3 for _ in range(8)]

    def run(constrained: bool) -> tuple[float, int]:
        states = [compiler.compile(guided) if constrained else None for _ in range(batch)]
        outputs: list[list[int]] = [[] for _ in range(batch)]
        finished = 0
        t0 = time.perf_counter()
        for step in range(steps):
            rows = [SamplingRow(params, [1], outputs[i], None, states[i]) for i in range(batch)]
            tokens = sampler(logits[step % len(logits)], rows).token_ids
            for i, t in enumerate(tokens):
                outputs[i].append(t)
                if constrained:
                    states[i].accept_token(t)
                    if states[i].is_terminated():  # start a new document in this row
                        finished += 1
                        states[i], outputs[i] = compiler.compile(guided), []
        return batch * steps / (time.perf_counter() - t0), finished

    run(True)  # warm up
    unconstrained, _ = run(False)
    constrained, finished = run(True)
    print(f"  unconstrained {unconstrained:8.0f} tok/s, structured {constrained:8.0f} tok/s "
          f"({constrained / unconstrained:.2f}x), {finished} documents completed")
    return {"batch": batch, "steps": steps, "tokens_per_s": {"unconstrained": unconstrained, "structured": constrained},
            "structured_vs_unconstrained": constrained / unconstrained, "documents_completed": finished,
            "tokenizer_info_s": setup_s, "schema_compile_s": compile_s, "cached_compile_s": cached_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"sampler overhead per step, batch {args.batch}, vocab {VOCAB}:")
    over = overhead(args.batch, args.steps)
    print(f"  all options / greedy: {over['all_options_vs_greedy']:.1f}x")
    print("structured output (JSON schema) vs unconstrained, sampler + grammar only:")
    struct = structured(args.batch, args.steps * 5)
    save("sampler", {"overhead": over, "structured": struct})


if __name__ == "__main__":
    main()
