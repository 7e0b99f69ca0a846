"""Offline throughput and latency measurements, with a stand-in for heron's LLM."""

from __future__ import annotations

from types import SimpleNamespace

from heron.bench.datasets import SampleRequest
from heron.bench.offline import format_latency, format_throughput, measure_latency, measure_throughput


class FakeLLM:
    """Returns ``max_tokens`` output tokens per prompt and remembers what it was asked."""

    def __init__(self) -> None:
        self.calls = []

    def get_tokenizer(self):
        return SimpleNamespace(vocab_size=100)

    def generate(self, prompts, params, use_tqdm=True):
        self.calls.append((prompts, params))
        params = params if isinstance(params, list) else [params] * len(prompts)
        return [SimpleNamespace(prompt_token_ids=[1] * (len(p["prompt_token_ids"]) if isinstance(p, dict) else 5),
                                outputs=[SimpleNamespace(token_ids=[0] * sp.max_tokens)])
                for p, sp in zip(prompts, params, strict=True)]


def test_throughput_counts_tokens_and_asks_for_fixed_lengths():
    llm = FakeLLM()
    m = measure_throughput(llm, [SampleRequest("a", 5, 3), SampleRequest("b", 5, 7)], progress=False)
    assert (m["num_requests"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 10, 10)
    assert m["output_throughput"] == 10 / m["elapsed_s"]
    (prompts, params), = llm.calls
    assert prompts == ["a", "b"] and [p.max_tokens for p in params] == [3, 7]
    assert all(p.ignore_eos and p.temperature == 0 for p in params)
    assert "requests/s" in format_throughput(m)


def test_latency_runs_warmup_plus_timed_iterations():
    llm = FakeLLM()
    m = measure_latency(llm, batch_size=4, input_len=9, output_len=6, iters=3, warmup_iters=2)
    assert len(llm.calls) == 5 and len(m["latencies_s"]) == 3
    prompts, params = llm.calls[0]
    assert len(prompts) == 4 and all(len(p["prompt_token_ids"]) == 9 for p in prompts)
    assert params.max_tokens == 6 and params.ignore_eos
    assert "batch of 4" in format_latency(m)
