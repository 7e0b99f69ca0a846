"""Offline benchmarks with the engine in-process: throughput over a dataset, latency of one batch."""

from __future__ import annotations

import time

import numpy as np

from heron.bench.datasets import SampleRequest
from heron.bench.metrics import describe


def _params(max_tokens: int):
    from heron.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def measure_throughput(llm, requests: list[SampleRequest], progress: bool = True) -> dict:
    """Generate every request at once through ``llm`` (a heron LLM); report requests and tokens per second."""
    prompts = [r.prompt for r in requests]
    params = [_params(r.expected_output_len) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    input_tokens = sum(len(o.prompt_token_ids or []) for o in outputs)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"num_requests": len(requests), "elapsed_s": elapsed,
            "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
            "request_throughput": len(requests) / elapsed, "output_throughput": output_tokens / elapsed,
            "total_token_throughput": (input_tokens + output_tokens) / elapsed}


def measure_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int, warmup_iters: int,
                    seed: int = 0) -> dict:
    """Time one batch of ``batch_size`` random prompts of ``input_len`` tokens, ``output_len`` out, end to end."""
    vocab = llm.get_tokenizer().vocab_size
    rng = np.random.default_rng(seed)
    prompts = [{"prompt_token_ids": rng.integers(0, vocab, size=input_len).tolist()} for _ in range(batch_size)]
    params = _params(output_len)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(warmup_iters):
        once()
    latencies = [once() for _ in range(iters)]
    return {"batch_size": batch_size, "input_len": input_len, "output_len": output_len, "iterations": iters,
            "latencies_s": latencies, "latency_ms": describe(latencies),
            "output_throughput": batch_size * output_len / float(np.mean(latencies))}


def format_throughput(m: dict) -> str:
    """One-paragraph terminal summary of ``measure_throughput``."""
    return (f"Throughput: {m['request_throughput']:.2f} requests/s, {m['total_token_throughput']:.1f} total tokens/s, "
            f"{m['output_throughput']:.1f} output tokens/s ({m['num_requests']} requests, "
            f"{m['total_input_tokens']} in / {m['total_output_tokens']} out tokens, {m['elapsed_s']:.2f} s)")


def format_latency(m: dict) -> str:
    """One-paragraph terminal summary of ``measure_latency``."""
    lat = m["latency_ms"]
    return (f"Latency of a batch of {m['batch_size']} ({m['input_len']} in, {m['output_len']} out), "
            f"{m['iterations']} iterations: mean {lat['mean']:.1f} ms, median {lat['median']:.1f} ms, "
            f"p90 {lat['p90']:.1f} ms, p99 {lat['p99']:.1f} ms; {m['output_throughput']:.1f} output tokens/s")
