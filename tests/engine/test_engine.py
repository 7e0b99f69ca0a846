"""Engine behaviour on tiny random models: batching, preemption, prefix caching, chunked prefill, limits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from heron import LLM, SamplingParams
from heron.errors import PromptTooLongError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def random_prompts(n: int, vocab: int, seed: int = 0, lo: int = 3, hi: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (n_tok,), generator=g).tolist() for n_tok in lengths]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))


def assert_no_leaks(llm: LLM) -> None:
    bm = llm.engine.core.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not llm.engine.core.scheduler.has_unfinished()


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llama_ref(llama_dir):
    return AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                         pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_equals_alone_equals_transformers(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, block_size=8, max_num_batched_tokens=256, dtype="float32")
    prompts = random_prompts(16, ref.config.vocab_size)
    together = run(llm, prompts)
    alone = [run(llm, [p])[0] for p in prompts]
    assert together == alone
    assert together == [hf_greedy(ref, p, GREEDY.max_tokens) for p in prompts]
    assert llm.engine.stats().max_running_seen > 1
    assert_no_leaks(llm)


def test_small_kv_pool_preempts_and_stays_correct(llama_dir, llama_ref):
    llm = LLM(llama_dir, block_size=4, num_gpu_blocks_override=40, max_num_batched_tokens=512, max_model_len=160, dtype="float32")
    prompts = random_prompts(12, llama_ref.config.vocab_size, seed=1, lo=20, hi=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = run(llm, prompts, params)
    assert llm.engine.stats().num_preemptions > 0
    assert got == [hf_greedy(llama_ref, p, 24) for p in prompts]
    assert_no_leaks(llm)


def test_shared_prefix_reuses_cached_blocks(llama_dir):
    prefix = random_prompts(1, 200, seed=2, lo=64, hi=65)[0]
    a, b = prefix + [5, 6, 7], prefix + [9, 10]
    cold = LLM(llama_dir, block_size=8, enable_prefix_caching=False, dtype="float32")
    expected = run(cold, [b])
    llm = LLM(llama_dir, block_size=8, dtype="float32")
    run(llm, [a])
    before = llm.engine.stats()
    assert run(llm, [b]) == expected
    after = llm.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64
    assert after.prompt_tokens - before.prompt_tokens == len(b) - 64
    assert_no_leaks(llm)


def test_long_prompt_is_prefilled_in_chunks(llama_dir, llama_ref):
    prompt = random_prompts(1, 200, seed=3, lo=150, hi=151)[0]
    chunked = LLM(llama_dir, block_size=8, max_num_batched_tokens=32, enable_prefix_caching=False, dtype="float32")
    whole = LLM(llama_dir, block_size=8, max_num_batched_tokens=512, enable_prefix_caching=False, dtype="float32")
    steps = 0
    chunked.engine.add_request("x", prompt, GREEDY)
    while chunked.engine.has_unfinished_requests():
        outs = chunked.engine.step()
        steps += 1
    assert steps >= 150 // 32 + GREEDY.max_tokens
    assert outs[0].outputs[0].token_ids == run(whole, [prompt])[0] == hf_greedy(llama_ref, prompt, 12)


def test_prompt_over_max_model_len_is_rejected_others_unaffected(llama_dir):
    llm = LLM(llama_dir, max_model_len=64, dtype="float32")
    llm.engine.add_request("ok", [5] * 10, GREEDY)
    with pytest.raises(PromptTooLongError, match="64"):
        llm.engine.add_request("long", [5] * 100, GREEDY)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs += [o for o in llm.engine.step() if o.finished]
    assert [o.request_id for o in outs] == ["ok"] and len(outs[0].outputs[0].token_ids) == 12
    assert_no_leaks(llm)


def test_generation_stops_at_max_model_len(llama_dir):
    llm = LLM(llama_dir, max_model_len=20, dtype="float32")
    out = llm.generate({"prompt_token_ids": [5] * 15}, SamplingParams(temperature=0, max_tokens=100,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_abort_frees_blocks_at_any_point(llama_dir):
    llm = LLM(llama_dir, block_size=4, max_num_batched_tokens=16, dtype="float32")
    engine = llm.engine
    engine.add_request("a", [7] * 40, GREEDY)  # mid-prefill after one step
    engine.add_request("b", [8] * 5, GREEDY)
    engine.add_request("c", [9] * 5, GREEDY)  # still waiting
    engine.step()
    for rid in ("a", "b", "c"):
        engine.abort_request(rid)
    outs = engine.step()
    assert {o.request_id for o in outs} == {"a", "b", "c"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outs)
    assert not engine.has_unfinished_requests()
    assert_no_leaks(llm)


def test_n_samples_fork_the_prompt_blocks(llama_dir):
    llm = LLM(llama_dir, block_size=8, dtype="float32")
    out = llm.generate({"prompt_token_ids": [4] * 21}, SamplingParams(n=3, temperature=0, max_tokens=10,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    single = run(llm, [[4] * 21], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert all(c.token_ids == single for c in out.outputs)
    assert_no_leaks(llm)


def test_priority_admits_urgent_requests_first(llama_dir):
    llm = LLM(llama_dir, max_num_seqs=1, dtype="float32")
    engine = llm.engine
    engine.add_request("late", [5] * 4, SamplingParams(temperature=0, max_tokens=2), priority=1)
    engine.add_request("urgent", [6] * 4, SamplingParams(temperature=0, max_tokens=2), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["urgent", "late"]


def test_stats_track_tokens_and_usage(llama_dir):
    llm = LLM(llama_dir, block_size=4, dtype="float32")
    engine = llm.engine
    engine.add_request("s", [3] * 9, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.step()
    mid = engine.stats()
    assert mid.num_running == 1 and mid.kv_cache_usage > 0
    while engine.has_unfinished_requests():
        engine.step()
    end = engine.stats()
    assert end.prompt_tokens == 9 and end.generation_tokens == 4
    assert end.kv_cache_usage == 0 and end.finished_by_reason == {"length": 1}
