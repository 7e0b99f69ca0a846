"""Speculative decoding on the default model: output tokens/s with and without it at concurrency 1, 8 and 32,
in one run on one machine.

Two tasks: an input-grounded one (copy or lightly rewrite a passage given in the prompt: n-gram prompt lookup
finds its drafts there) and open chat prompts (nothing to look up: a model must draft). Every mode runs the same
greedy requests; speculation must give exactly the plain engine's tokens, which is checked and reported.
Concurrency c sends c requests at once to one in-process engine (c = 1: one after another); a figure is the
best of ``--repeats`` runs, the plain and speculative engines alternating.

    python -m benchmarks.bench_spec --write-docs
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from dataclasses import dataclass, field

from benchmarks.bench_quant import TEXT, load_text, write_docs
from benchmarks.common import machine, save

DOCS_HEADING = "## Speculative decoding"
CONCURRENCY = (1, 8, 32)

INSTRUCTIONS = ["Repeat the following passage exactly, word for word:",
                "Copy this text without changing anything:",
                "Rewrite the following passage, keeping every sentence as it is:",
                "Here is a paragraph. Write it out again exactly:"]

CHAT_TOPICS = ["how rainbows form", "why the sky is blue", "the water cycle", "how a bicycle stays upright",
               "what a black hole is", "how bees make honey", "why we have seasons", "how vaccines work",
               "the history of the printing press", "how a refrigerator works", "what causes earthquakes",
               "how plants grow from seeds", "why cats purr", "how airplanes fly", "what DNA is",
               "how the internet works", "why leaves change color", "how volcanoes erupt", "what clouds are made of",
               "how a compass works", "why the moon has phases", "how batteries store energy", "what photosynthesis is",
               "how tides work", "why bread rises", "how a camera works", "what gravity is", "how glaciers move",
               "why ice floats", "how the heart pumps blood", "what a rainforest is", "how coral reefs form"]


@dataclass
class Mode:
    """One engine setting: a label, its ``speculative_config`` (None: plain decoding) and engine arguments on top
    of ``--engine-args``."""

    name: str
    spec: dict | None
    engine: dict = field(default_factory=dict)


def grounded_prompts(num: int) -> list[list[dict]]:
    """Chat requests that ask to reproduce a passage of the benchmark text (CC0, benchmarks/data)."""
    passages = [p.strip() for p in load_text(TEXT).split("\n\n") if len(p.strip()) > 300]
    return [[{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{passages[i % len(passages)]}"}]
            for i in range(num)]


def chat_prompts(num: int) -> list[list[dict]]:
    return [[{"role": "user", "content": f"Explain {CHAT_TOPICS[i % len(CHAT_TOPICS)]} in a short paragraph."}]
            for i in range(num)]


def run_once(llm, conversations: list[list[dict]], concurrency: int, max_tokens: int) -> dict:
    """Output tokens/s of the conversations sent ``concurrency`` at a time, the tokens, and acceptance deltas."""
    from heron import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    before = llm.engine.stats()
    start = time.perf_counter()
    tokens = []
    for i in range(0, len(conversations), concurrency):
        outs = llm.chat(conversations[i:i + concurrency], params, use_tqdm=False)
        tokens += [o.outputs[0].token_ids for o in outs]
    seconds = time.perf_counter() - start
    after = llm.engine.stats()
    drafts = after.num_drafts - before.num_drafts
    draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    return {"tokens_per_s": sum(map(len, tokens)) / seconds, "output_tokens": sum(map(len, tokens)),
            "seconds": seconds, "num_drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "mean_accepted_length": 1 + accepted / drafts if drafts else None, "token_ids": tokens}


def measure(args: argparse.Namespace, task: str, conversations_for, modes: list[Mode]) -> dict:
    """Every mode of one task at every concurrency; the plain engine first in each pair."""
    from heron import LLM

    engines = {m.name: LLM(args.model, speculative_config=m.spec, **{**args.engine, **m.engine}) for m in modes}
    out: dict[str, dict] = {m.name: {} for m in modes}
    for c in CONCURRENCY:
        conversations = conversations_for(max(c, args.requests_c1) if c == 1 else c)
        for m in modes:  # warm-up: allocations, the cost model's first measurements
            run_once(engines[m.name], conversations[:1], 1, 8)
        for _ in range(args.repeats):
            for m in modes:
                r = run_once(engines[m.name], conversations, c, args.max_tokens)
                best = out[m.name].get(str(c))
                if best is None or r["tokens_per_s"] > best["tokens_per_s"]:
                    out[m.name][str(c)] = r
        plain = out[modes[0].name][str(c)]
        for m in modes[1:]:
            r = out[m.name][str(c)]
            r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"]
            r["identical_greedy"] = r["token_ids"] == plain["token_ids"]
        print(f"{task} c={c}: " + ", ".join(f"{m.name} {out[m.name][str(c)]['tokens_per_s']:.1f}" for m in modes),
              flush=True)
    for per_c in out.values():
        for r in per_c.values():
            r.pop("token_ids")
    return out


def render_section(result: dict) -> str:
    m = result["machine"]
    lines = [DOCS_HEADING, "",
             "<!-- written by `python -m benchmarks.bench_spec --write-docs`; edits here are replaced -->", "",
             f"`python -m benchmarks.bench_spec --write-docs` on {m['cpu']} ({m['cores']} vCPUs, torch {m['torch']}), "
             f"{m['date'][:10]}, model `{result['settings']['model']}` (the GGUF kept quantized), greedy, up to "
             f"{result['settings']['max_tokens']} output tokens per request, best of {result['settings']['repeats']} "
             "alternating runs. Output tokens/s over whole requests (prefill included); acceptance = accepted / "
             "proposed draft tokens; speed-up against the plain engine of the same run.", ""]
    for task, modes in result["tasks"].items():
        lines += [f"**{task}**", "", "| mode | c=1 tok/s | c=8 | c=32 | speed-up c=1 / 8 / 32 | acceptance c=1 | "
                  "identical greedy |", "|---|---|---|---|---|---|---|"]
        for name, per_c in modes.items():
            rates = " | ".join(f"{per_c[str(c)]['tokens_per_s']:.1f}" for c in CONCURRENCY)
            speedups = " / ".join(f"{per_c[str(c)]['speedup']:.2f}x" if "speedup" in per_c[str(c)] else "1"
                                  for c in CONCURRENCY)
            acc = per_c["1"]["acceptance_rate"]
            same = all(per_c[str(c)].get("identical_greedy", True) for c in CONCURRENCY)
            lines.append(f"| {name} | {rates} | {speedups} | {'-' if acc is None else f'{acc:.0%}'} | "
                         f"{'yes' if same else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--requests-c1", type=int, default=4, help="requests sent one after another at c=1")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--engine-args", default='{"enable_prefix_caching": false}',
                        help="LLM(...) arguments as JSON (default: no prefix caching, so every repeat computes its prompts)")
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/benchmarks.md")
    args = parser.parse_args()
    args.engine = json.loads(args.engine_args)
    k = args.num_speculative_tokens
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    self_draft = {"method": "self_draft", "num_speculative_tokens": 3}
    q4_k, dense = 8, {"quantization": "none"}
    q4_draft = {"method": "self_draft", "quantization": "gguf", "num_speculative_tokens": q4_k}
    tasks = {
        "Grounded task (reproduce a passage in the prompt), n-gram": (grounded_prompts, [
            Mode("plain", None), Mode(f"ngram k={k}", ngram),
            Mode(f"ngram k={k}, always on", {**ngram, "disable_by_batch_size": 10**6})]),
        "Open chat prompts, self-draft (24 of 30 layers)": (chat_prompts, [
            Mode("plain", None), Mode("self-draft k=3", self_draft),
            Mode("self-draft k=3, always on", {**self_draft, "disable_by_batch_size": 10**6}),
            Mode(f"ngram k={k}", ngram)]),
        # the target dequantized to bfloat16, the draft its own Q4_1 blocks: ~2x cheaper per token, and it agrees
        "Open chat prompts, bfloat16 target (`--quantization none`), self-draft = the GGUF's Q4_1 blocks": (
            chat_prompts, [Mode("plain bf16", None, dense),
                           Mode(f"Q4_1 self-draft k={q4_k}", q4_draft, dense),
                           Mode(f"Q4_1 self-draft k={q4_k}, always on", {**q4_draft, "disable_by_batch_size": 10**6},
                                dense)]),
    }
    result = {"settings": {"model": args.model, "max_tokens": args.max_tokens, "repeats": args.repeats,
                           "engine": args.engine},
              "tasks": {task: measure(args, task, prompts, modes) for task, (prompts, modes) in tasks.items()}}
    result["machine"] = machine()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d/spec_%H%M%S")
    save(f"spec-{stamp}", result)
    if args.write_docs:
        print(f"wrote {write_docs(render_section(result))}")


if __name__ == "__main__":
    main()
