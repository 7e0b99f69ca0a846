"""Tensor parallelism over gloo on the CPU: TP=2 (and TP=4) give TP=1's greedy tokens, through prefix-cache hits,
chunked prefill and preemption; bad degrees fail at start with one message and leave no process behind."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys

import pytest
import torch
from helpers import TINY_ARCHS, build_tiny_model

from heron import LLM, SamplingParams
from heron.errors import ConfigError

pytestmark = pytest.mark.slow

PREFIX = "Paged attention stores keys and values in fixed-size blocks of sixteen tokens. "
PROMPTS = [PREFIX + "Once upon a time", PREFIX + "The quick brown fox", "Hello, world! How are you",
           PREFIX + "def add(a, b):", "Once upon a time there was a little heron"]
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, logprobs=2)


def generate(model, tp: int, **engine_args) -> tuple[list[list[int]], list[list[float]], object]:
    """Greedy tokens and their logprobs of two rounds of PROMPTS (the second hits the prefix cache)."""
    llm = LLM(str(model), dtype="float32", tensor_parallel_size=tp, max_num_batched_tokens=32, **engine_args)
    try:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False) + llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs, strict=True)]
                for o in outs]
    return tokens, logprobs, stats


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tp2_gives_the_tokens_of_tp1(arch, tiny_model_dir):
    model = tiny_model_dir(arch)
    # 12 blocks of 16 hold the five sequences only in turns: preemption and recompute under both
    tokens1, logprobs1, stats1 = generate(model, 1, num_gpu_blocks_override=12, max_model_len=128)
    tokens2, logprobs2, stats2 = generate(model, 2, num_gpu_blocks_override=12, max_model_len=128)
    assert tokens2 == tokens1
    torch.testing.assert_close(torch.tensor(logprobs2), torch.tensor(logprobs1), atol=1e-4, rtol=0)
    for stats in (stats1, stats2):
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
        assert stats.num_blocks_free == stats.num_blocks_total  # nothing leaked on rank 0's books
    assert not multiprocessing.active_children()  # the rank processes are gone after shutdown


def test_tp4_replicates_kv_heads_and_pads_the_vocabulary(tmp_path):
    # 2 KV heads over 4 ranks (each pair of ranks holds one), and 321 tokens: 81 rows per rank, 3 padding
    model = build_tiny_model("qwen2", tmp_path / "m", vocab_size=321)
    tokens1, logprobs1, _ = generate(model, 1)
    tokens4, logprobs4, _ = generate(model, 4)
    assert tokens4 == tokens1
    torch.testing.assert_close(torch.tensor(logprobs4), torch.tensor(logprobs1), atol=1e-4, rtol=0)


def prompt_logprobs(model, tp: int, quantization: str) -> torch.Tensor:
    """Teacher-forced logprobs of every prompt token (no generated token feeds back a rounding difference)."""
    llm = LLM(str(model), dtype="float32", tensor_parallel_size=tp, quantization=quantization)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.engine.shutdown()
    return torch.tensor([next(iter(lp.values())).logprob for o in outs for lp in o.prompt_logprobs[1:]])


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_quantized_weights_shard_with_their_scales(quantization, tiny_model_dir):
    # each rank quantizes its own part of every layer; a row-parallel layer's groups (int8: up to 128 inputs)
    # or row scales (fp8) then cover fewer inputs than at TP=1, so the rounding differs a little
    model = tiny_model_dir("llama")
    dense = prompt_logprobs(model, 1, None)
    tp1, tp2 = prompt_logprobs(model, 1, quantization), prompt_logprobs(model, 2, quantization)
    torch.testing.assert_close(tp2, tp1, atol=0, rtol=0.03)
    # sharded, the quantized model stays as close to the dense one as unsharded (a part loaded with another
    # part's scales would be off by far more than the format's own rounding)
    assert (tp2 - dense).abs().mean() <= 2 * (tp1 - dense).abs().mean()


@pytest.mark.parametrize("tp, needle", [
    (3, "--tensor-parallel-size 3 does not split this model: it has 4 attention heads"),
    (8, "--tensor-parallel-size 8 does not split this model: it has 4 attention heads"),
])
def test_degree_the_model_cannot_split_fails_at_start(tp, needle, tiny_model_dir):
    with pytest.raises(ConfigError, match=needle):
        LLM(str(tiny_model_dir("llama")), dtype="float32", tensor_parallel_size=tp)
    assert not multiprocessing.active_children()


def test_ngram_speculation_and_sampled_n_under_tp2(tiny_model_dir):
    # n-gram drafts verified in rank 0's sampler; n = 2 forks share prompt blocks (copy-on-write on every rank)
    model = tiny_model_dir("qwen3")
    prompts = ["one two three one two three one two three one two", PREFIX]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, n=2)
    outs = []
    for tp, engine_args in [(1, {}), (2, {"speculative_config": spec})]:
        llm = LLM(str(model), dtype="float32", tensor_parallel_size=tp, **engine_args)
        try:
            outs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
            if engine_args:
                assert llm.engine.stats().num_accepted_tokens > 0
        finally:
            llm.engine.shutdown()
    assert outs[1] == outs[0]


def test_embeddings_under_tp2(tiny_model_dir):
    vectors = []
    for tp in (1, 2):
        llm = LLM(str(tiny_model_dir("llama")), dtype="float32", tensor_parallel_size=tp, runner="pooling")
        try:
            vectors.append(torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)]))
        finally:
            llm.engine.shutdown()
    torch.testing.assert_close(vectors[1], vectors[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("quantization", ["gguf", "none"])
def test_default_model_in_three_ranks(quantization, smollm2_path):
    # SmolLM2-135M: 9 heads, 3 KV heads, so TP=3; its Q4_1 blocks are cut whole: rows, and columns at 32
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=2)
    prompt = ["The capital of France is"]
    outs = []
    for tp in (1, 3):
        llm = LLM("smollm2-135m-instruct", dtype="float32", quantization=quantization, tensor_parallel_size=tp,
                  max_model_len=256)
        try:
            outs.append(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0])
        finally:
            llm.engine.shutdown()
    assert all("Paris" in o.text for o in outs), [o.text for o in outs]
    # dense weights: only the order of float sums differs. GGUF: the kernel rounds activations to int8 per 32
    # inputs, and a sum order's last bit flips some roundings, which 30 layers amplify: scaling the embedding
    # by 1 + 1e-6 moves this prompt's logprobs by up to 0.1 at TP=1 (dense: not at all)
    atol = 0.3 if quantization == "gguf" else 1e-3
    same = 0
    while same < len(outs[0].token_ids) and outs[0].token_ids[same] == outs[1].token_ids[same]:
        same += 1
    lps = [[lp[t].logprob for t, lp in zip(o.token_ids[:same], o.logprobs, strict=False)] for o in outs]
    torch.testing.assert_close(torch.tensor(lps[1]), torch.tensor(lps[0]), atol=atol, rtol=0)
    if same < len(outs[0].token_ids):
        # greedy may part only at a near-tie, which those differences decide (on an Intel Xeon with AMX: token 5,
        # its two candidates 0.002 nats apart at TP=1 and 0.015 at TP=3; identical on AMD Zen 4)
        pair = {o.token_ids[same] for o in outs}
        for o in outs:
            step = o.logprobs[same]
            assert pair <= step.keys(), (same, pair, step)
            first, other = (step[t].logprob for t in pair)
            assert abs(first - other) < atol, (same, step)


def test_script_without_main_guard_is_told_why_its_ranks_die(tiny_model_dir, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("import sys\nfrom heron import LLM\n"
                      "LLM(sys.argv[1], dtype='float32', tensor_parallel_size=2)\n")
    run = subprocess.run([sys.executable, str(script), str(tiny_model_dir("llama"))], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode != 0
    assert "exited with code 1 before heron's code ran in it" in run.stderr, run.stderr[-3000:]
    assert 'if __name__ == "__main__":' in run.stderr
