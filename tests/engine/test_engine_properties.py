"""The whole engine under random load (hypothesis): random pools, prompts, max_tokens, n, priorities, drafts
and aborts. Every request ends exactly once (finished, aborted, or refused with a clear error), no step plans
nothing while work is pending, preemption always takes the lowest-priority newest sequence, ``--max-num-seqs``
holds with forked samples, and no block leaks."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from heron.config import EngineConfig
from heron.engine.engine import Engine
from heron.errors import ConfigError, HeronError, InvalidRequestError, PromptTooLongError
from heron.sampling_params import SamplingParams

BLOCK = 4
MAX_STEPS = 3000


class RandomProposer:
    """Drafts random tokens (mostly wrong: exercises rollback), sometimes none."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, seqs, limits):
        return {s.seq_id: [self.rng.randrange(3, 8) for _ in range(self.rng.randrange(0, 4))]
                for s in seqs if self.rng.random() < 0.5}


request_st = st.fixed_dictionaries({
    "prompt_len": st.integers(1, 70),
    "alphabet": st.integers(3, 6),  # a small alphabet: prompts share prefixes, the prefix cache gets hits
    "max_tokens": st.integers(1, 40),
    "n": st.integers(1, 3),
    "priority": st.integers(0, 2),
    "temperature": st.sampled_from([0.0, 1.0]),
    "abort_at": st.one_of(st.none(), st.integers(0, 30)),
})


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_blocks=st.integers(2, 48), max_model_len=st.sampled_from([32, 64]), max_num_seqs=st.integers(1, 6),
       budget=st.sampled_from([8, 24, 128]), prefix_caching=st.booleans(), drafts=st.booleans(),
       requests=st.lists(request_st, min_size=1, max_size=10), seed=st.integers(0, 1000))
def test_every_request_ends_and_nothing_leaks(model_dir, num_blocks, max_model_len, max_num_seqs, budget,
                                              prefix_caching, drafts, requests, seed):
    config = dict(model=str(model_dir), block_size=BLOCK, num_gpu_blocks_override=num_blocks,
                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                  enable_prefix_caching=prefix_caching)
    if num_blocks * BLOCK < max_model_len:
        with pytest.raises(ConfigError, match="max-model-len"):
            Engine(EngineConfig(**config))
        return
    engine = Engine(EngineConfig(**config))
    core = engine.core
    if drafts:
        core.proposer = RandomProposer(seed)
    check_preemption_order(core)
    rng = random.Random(seed)
    pending: dict[str, dict] = {}
    for i, r in enumerate(requests):
        prompt = [rng.randrange(3, 3 + r["alphabet"]) for _ in range(r["prompt_len"])]
        params = SamplingParams(temperature=r["temperature"], seed=rng.randrange(2**63), max_tokens=r["max_tokens"],
                                n=r["n"], ignore_eos=rng.random() < 0.8)
        try:
            engine.add_request(str(i), prompt, params, priority=r["priority"])
        except HeronError as e:
            too_long = len(prompt) >= max_model_len
            assert isinstance(e, PromptTooLongError if too_long else InvalidRequestError)
            assert too_long or r["n"] > max_num_seqs
            continue
        pending[str(i)] = r
    finished: set[str] = set()
    for step in range(MAX_STEPS):
        if not engine.has_unfinished_requests():
            break
        for rid, r in pending.items():
            if r["abort_at"] == step and rid not in finished:
                engine.abort_request(rid)
        for out in engine.step():  # raises SchedulerStalledError if it plans nothing with work pending
            assert out.request_id not in finished, "a request finished twice"
            if out.finished:
                finished.add(out.request_id)
                r = pending[out.request_id]
                reasons = {c.finish_reason for c in out.outputs}
                assert reasons <= {"stop", "length", "abort"}, reasons
                if "abort" not in reasons:
                    assert len(out.outputs) == r["n"]
                    assert all(len(c.token_ids) <= r["max_tokens"] for c in out.outputs)
        check_state(core, max_num_seqs)
    else:
        pytest.fail(f"not done after {MAX_STEPS} steps")
    assert finished == set(pending)
    bm = core.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
    assert not core.requests and not core.scheduler.has_unfinished()
    assert not engine.output_processor.requests


def check_state(core, max_num_seqs: int) -> None:
    bm, sched = core.block_manager, core.scheduler
    bm.check_invariants()
    assert len(sched.running) <= max_num_seqs
    refs = [0] * bm.num_blocks
    for seq in sched.running:
        assert len(seq.block_table) <= bm.blocks_needed(len(seq)), "draft slots were not rolled back"
        for b in seq.block_table:
            refs[b] += 1
    for seq in sched.waiting:
        assert not seq.block_table
    assert refs == [b.ref_count for b in bm.blocks]


def check_preemption_order(core) -> None:
    """Wrap the scheduler's preemption: the victim must be the lowest-priority, newest running sequence."""
    sched = core.scheduler
    real = sched._preempt

    def preempt(seq):
        assert seq.sort_key == max(s.sort_key for s in sched.running), "preempted the wrong sequence"
        real(seq)

    sched._preempt = preempt
