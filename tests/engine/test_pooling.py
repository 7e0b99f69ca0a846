"""Pooling through the engine (runner="pooling"): vectors equal transformers' hidden states pooled directly,
across prefill chunks and a preemption, alone or batched; no KV block is left held."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel

from heron import LLM, PoolingParams, SamplingParams
from heron.config import EngineConfig
from heron.engine.pooling import PoolingState
from heron.errors import ConfigError, InvalidRequestError
from heron.pooling_params import PoolerConfig

CHUNK = 16  # max_num_batched_tokens: prompts longer than this are pooled over several steps
TEXT = "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away."


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def hf_model(llama_dir):
    return AutoModel.from_pretrained(llama_dir, dtype=torch.float32).eval()


def pooling_llm(model_dir, pooling_type: str = "LAST", **kw) -> LLM:
    return LLM(model_dir, runner="pooling", pooler_config={"pooling_type": pooling_type}, dtype="float32",
               max_model_len=256, max_num_batched_tokens=CHUNK, **kw)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.no_grad()
def reference(hf_model, token_ids: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    """The pooled final hidden states (transformers applies the final norm) of a float32 forward."""
    hidden = hf_model(torch.tensor([token_ids])).last_hidden_state[0]
    vector = {"MEAN": hidden.mean(0), "LAST": hidden[-1], "CLS": hidden[0]}[pooling_type]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def assert_no_blocks_held(llm: LLM) -> None:
    core = llm.engine.core
    core.block_manager.check_invariants()
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not core.scheduler.has_unfinished() and not core.requests


@pytest.mark.parametrize("pooling_type", ["MEAN", "LAST", "CLS"])
def test_pooled_vector_equals_transformers_across_chunks(llama_dir, hf_model, pooling_type):
    llm = pooling_llm(llama_dir, pooling_type)
    prompts = [prompt(5 * CHUNK + 3), prompt(7, seed=1), prompt(CHUNK, seed=2)]
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        got = torch.tensor(out.outputs.embedding)
        assert out.prompt_token_ids == p and out.outputs.hidden_size == hf_model.config.hidden_size
        torch.testing.assert_close(got, reference(hf_model, p, pooling_type), atol=1e-5, rtol=0)
        assert abs(got.norm().item() - 1) < 1e-5
    assert_no_blocks_held(llm)


def test_normalize_off_gives_the_raw_hidden_state(llama_dir, hf_model):
    llm = pooling_llm(llama_dir, "LAST")
    p = prompt(3 * CHUNK + 1)
    out = llm.embed({"prompt_token_ids": p}, PoolingParams(normalize=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(out.outputs.embedding), reference(hf_model, p, "LAST", normalize=False),
                               atol=1e-5, rtol=1e-5)


def test_alone_equals_batched_and_text_equals_token_ids(llama_dir):
    llm = pooling_llm(llama_dir, "MEAN")
    alone = llm.embed(TEXT, use_tqdm=False)[0]
    others = [prompt(n, seed=n) for n in (3, 40, 17, 64)]
    batch = llm.embed([{"prompt_token_ids": others[0]}, TEXT, *({"prompt_token_ids": p} for p in others[1:])],
                      use_tqdm=False)
    ids = llm.get_tokenizer().encode(TEXT)
    by_ids = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    assert alone.prompt_token_ids == batch[1].prompt_token_ids == by_ids.prompt_token_ids == ids
    torch.testing.assert_close(torch.tensor(batch[1].outputs.embedding), torch.tensor(alone.outputs.embedding),
                               atol=1e-5, rtol=0)
    assert by_ids.outputs.embedding == alone.outputs.embedding
    assert_no_blocks_held(llm)


def test_preempted_mean_counts_each_position_once(llama_dir, hf_model):
    """Preemption recomputes a prompt from its start: positions already folded in must not count twice."""
    llm = pooling_llm(llama_dir, "MEAN")
    p = prompt(4 * CHUNK + 5, seed=3)
    engine, core = llm.engine, llm.engine.core
    engine.add_request("r", p, PoolingParams())
    engine.step()
    engine.step()
    seq = core.requests["r"].seqs[0]
    assert seq.num_computed_tokens == 2 * CHUNK
    core.scheduler._preempt(seq)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert core.scheduler.num_preemptions == 1 and len(outs) == 1
    torch.testing.assert_close(torch.tensor(outs[0].pooled), reference(hf_model, p, "MEAN"), atol=1e-5, rtol=0)
    assert_no_blocks_held(llm)


def test_last_pooling_uses_the_prefix_cache_and_mean_bypasses_it(llama_dir, hf_model):
    p = prompt(3 * CHUNK + 2, seed=4)
    for pooling_type in ("LAST", "MEAN"):
        llm = pooling_llm(llama_dir, pooling_type)
        first, second = (llm.embed({"prompt_token_ids": p}, use_tqdm=False)[0] for _ in range(2))
        assert first.outputs.embedding == second.outputs.embedding
        torch.testing.assert_close(torch.tensor(second.outputs.embedding), reference(hf_model, p, pooling_type),
                                   atol=1e-5, rtol=0)
        hits = llm.engine.core.block_manager.prefix_hits
        assert (hits > 0) == (pooling_type == "LAST")
        assert_no_blocks_held(llm)


def test_a_prompt_of_the_whole_context_can_be_pooled(llama_dir):
    llm = pooling_llm(llama_dir)
    assert llm.embed({"prompt_token_ids": prompt(256)}, use_tqdm=False)[0].outputs.hidden_size == 64
    with pytest.raises(InvalidRequestError, match="maximum context length is 256 tokens, but the input has 257"):
        llm.embed({"prompt_token_ids": prompt(257)}, use_tqdm=False)
    assert_no_blocks_held(llm)


def test_runner_and_request_kind_must_agree(llama_dir):
    with pytest.raises(InvalidRequestError, match="cannot generate text"):
        pooling_llm(llama_dir).generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    generator = LLM(llama_dir, dtype="float32", max_model_len=256)
    with pytest.raises(InvalidRequestError, match="runner='pooling'"):
        generator.embed("hi", use_tqdm=False)


def test_runner_flags_and_pooler_config():
    assert EngineConfig(model="m", task="embed").runner == "pooling"
    assert EngineConfig(model="m").runner == "generate"
    assert EngineConfig(model="m", runner="pooling", pooler_config='{"pooling_type": "mean"}').pooler == \
        PoolerConfig("MEAN", True)
    for kw, needle in [({"runner": "generate", "task": "embed"}, "contradicts"),
                       ({"pooler_config": '{"pooling_type": "MEAN"}'}, "--runner pooling only"),
                       ({"runner": "pooling", "pooler_config": '{"pooling_type": "MAX"}'}, "LAST, MEAN, CLS"),
                       ({"runner": "pooling", "pooler_config": '{"dimensions": 8}'}, "unsupported key"),
                       ({"runner": "pooling", "pooler_config": "{"}, "not valid JSON")]:
        with pytest.raises(ConfigError, match=needle):
            EngineConfig(model="m", **kw)


def test_pooling_state_skips_positions_computed_again():
    rows = torch.randn(40, 8)
    once = PoolingState("MEAN", True, 40)
    once.add(rows[:16], 16)
    once.add(rows[16:], 40)
    again = PoolingState("MEAN", True, 40)
    for lo, hi in [(0, 16), (16, 32), (0, 16), (16, 32), (32, 40)]:  # preempted after 32, recomputed
        again.add(rows[lo:hi], hi)
    expected = torch.nn.functional.normalize(rows.mean(0), dim=-1)
    for state in (once, again):
        got = torch.frombuffer(bytearray(state.output), dtype=torch.float32)
        torch.testing.assert_close(got, expected)
