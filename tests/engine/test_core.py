"""The engine core's v2 guarantees: refusal of pools that cannot finish a sequence, several tokens per step
with rollback (drafts), per-request failure isolation, bounded prompt-logprob memory, a freeable KV pool."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import assert_no_leaks

from heron import LLM, SamplingParams
from heron.engine.core import PROMPT_LOGPROBS_SLICE
from heron.errors import ConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run(llm: LLM, ps: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY):
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


def test_pool_smaller_than_one_sequence_is_refused_at_start(llama_dir):
    with pytest.raises(ConfigError, match=r"max-model-len 512 needs 32 blocks.*lower --max-model-len to at most 64"):
        LLM(llama_dir, num_gpu_blocks_override=4, dtype="float32")


def test_sequence_outgrowing_the_pool_finishes_instead_of_stalling(llama_dir):
    """The v1 stall: one sequence growing past what a tiny pool holds. Now it ends at max_model_len."""
    llm = LLM(llama_dir, num_gpu_blocks_override=4, max_model_len=64, dtype="float32")
    out = run(llm, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 61
    assert_no_leaks(llm)


class OracleProposer:
    """Proposes the known greedy continuation, with every ``wrong``-th draft token corrupted."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], k: int, wrong: int = 0) -> None:
        self.expected, self.k, self.wrong = expected, k, wrong
        self.calls = 0

    def propose(self, seqs, limits):
        drafts = {}
        for seq in seqs:
            full = self.expected[tuple(seq.request.prompt_token_ids)]
            done = seq.num_output_tokens
            d = list(full[done:done + self.k])
            for i in range(len(d)):
                self.calls += 1
                if self.wrong and self.calls % self.wrong == 0:
                    d[i] = (d[i] + 1) % 300
            drafts[seq.seq_id] = d
        return drafts


@pytest.mark.parametrize(("k", "wrong"), [(4, 0), (3, 3), (5, 2)])
def test_drafts_give_the_same_tokens_and_logprobs_and_roll_back(llama_dir, k, wrong):
    ps = prompts(6)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    plain = run(LLM(llama_dir, block_size=4, dtype="float32"), ps, params)
    expected = {tuple(p): o.outputs[0].token_ids for p, o in zip(ps, plain, strict=True)}
    llm = LLM(llama_dir, block_size=4, dtype="float32")
    llm.engine.core.proposer = OracleProposer(expected, k, wrong)
    spec = run(llm, ps, params)
    stats = llm.engine.stats()
    assert stats.num_draft_tokens > 0
    if wrong:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    else:
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # logprobs depend on the keys and values of every earlier position: accepted drafts' KV is exact
        for da, db in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(da) == list(db)
            assert [x.logprob for x in da.values()] == pytest.approx([x.logprob for x in db.values()], abs=1e-5)
    assert_no_leaks(llm)


@pytest.mark.parametrize("stop", ["max_tokens", "stop_token_ids", "stop_string"])
def test_stops_inside_an_accepted_run_cut_where_plain_decoding_cuts(llama_dir, stop):
    p = prompts(1, seed=4)[0]
    base = LLM(llama_dir, dtype="float32")
    full = run(base, [p])[0].outputs[0]
    if stop == "max_tokens":
        params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    elif stop == "stop_token_ids":
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[full.token_ids[6]])
    else:
        text = base.get_tokenizer().decode(full.token_ids[6:8])
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[text.strip() or text])
    plain = run(base, [p], params)[0].outputs[0]
    llm = LLM(llama_dir, dtype="float32")
    llm.engine.core.proposer = OracleProposer({tuple(p): full.token_ids}, k=8)
    spec = run(llm, [p], params)[0].outputs[0]
    assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == \
        (plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
    assert len(spec.token_ids) < 20
    assert_no_leaks(llm)


def test_a_failing_sampling_row_fails_only_its_request(llama_dir, monkeypatch):
    llm = LLM(llama_dir, dtype="float32")
    sampler = llm.engine.core.sampler
    real_call = type(sampler).__call__

    def flaky(self, logits, rows):
        if any(r.params.seed == 13 for r in rows):
            raise RuntimeError("poisoned row")
        return real_call(self, logits, rows)

    monkeypatch.setattr(type(sampler), "__call__", flaky)
    ps = prompts(4, seed=2)
    params = [GREEDY, SamplingParams(temperature=1.0, seed=13, max_tokens=20), GREEDY, GREEDY]
    outs = run(llm, ps, params)
    assert outs[1].outputs[0].finish_reason == "error" and "poisoned row" in outs[1].error
    good = [o.outputs[0].token_ids for i, o in enumerate(outs) if i != 1]
    assert good == [o.outputs[0].token_ids for o in run(LLM(llama_dir, dtype="float32"), [ps[0], ps[2], ps[3]])]
    assert run(llm, ps[:1])[0].outputs[0].token_ids == good[0]  # the engine keeps serving
    assert_no_leaks(llm)


def test_prompt_logprobs_are_computed_a_slice_at_a_time(llama_dir, monkeypatch):
    llm = LLM(llama_dir, max_num_batched_tokens=1024, dtype="float32")
    runner = llm.engine.core.runner
    sizes = []
    real = runner.compute_logits
    monkeypatch.setattr(runner, "compute_logits", lambda h: sizes.append(h.shape[0]) or real(h))
    prompt = prompts(1)[0] * 30
    prompt = prompt[:500]
    out = run(llm, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert len(out.prompt_logprobs) == 500
    assert max(sizes) <= PROMPT_LOGPROBS_SLICE and sum(sizes) >= 499
    monkeypatch.setattr("heron.engine.core.PROMPT_LOGPROBS_SLICE", 10**6)  # the reference: all rows at once
    whole = LLM(llama_dir, max_num_batched_tokens=1024, dtype="float32")
    ref = run(whole, [prompt], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    assert [d and next(iter(d.values())).logprob for d in out.prompt_logprobs] == \
        pytest.approx([d and next(iter(d.values())).logprob for d in ref.prompt_logprobs], abs=1e-5)


def test_kv_pool_is_freed_when_replaced(llama_dir):
    """The pool has no holders left once the runner lets go (v1 kept the CUDA profiling pool alive)."""
    llm = LLM(llama_dir, dtype="float32")
    runner = llm.engine.core.runner
    old = weakref.ref(runner.kv_caches[0])
    runner.allocate_kv_cache(8, torch.float32)
    gc.collect()
    assert old() is None
    runner.free_kv_cache()
    assert all(layer.kv_cache is None for layer in runner.layers)


def test_refused_prompt_in_a_batch_leaves_nothing_queued(llama_dir):
    llm = LLM(llama_dir, max_model_len=64, dtype="float32")
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([{"prompt_token_ids": [5] * 10}, {"prompt_token_ids": [5] * 100}], GREEDY, use_tqdm=False)
    assert_no_leaks(llm)
    assert not llm.engine.output_processor.requests
    assert len(run(llm, [[5] * 10])) == 1


def test_largest_seed_with_n_samples_runs(llama_dir):
    """seed + i past 2**64 (v1 crashed the engine step); out-of-range seeds are refused up front."""
    llm = LLM(llama_dir, dtype="float32")
    out = run(llm, [[5, 6, 7]], SamplingParams(seed=2**64 - 1, n=2, max_tokens=4, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [4, 4]
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**64)
    assert_no_leaks(llm)
