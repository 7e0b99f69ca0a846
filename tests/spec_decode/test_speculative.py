"""Speculative decoding through the engine on tiny random models: every proposer gives the plain engine's greedy
tokens (and logprobs, and KV contents) in a mixed batch, sampling keeps the target's distribution (chi-square,
positions after rejections included), seeds hold whatever the batch, stops cut where plain decoding cuts, and
nothing leaks."""

from __future__ import annotations

import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import assert_no_leaks, build_tiny_model, heron_logits
from safetensors.torch import load_file, save_file

from heron import LLM, SamplingParams
from heron.errors import ConfigError

FORCED = {"disable_by_batch_size": 10**6}  # speculate at every batch size: no timing-dependent policy
BASE = dict(dtype="float32", block_size=4, max_num_batched_tokens=40, seed=0)
SPECS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 4},
    "self_draft": {"method": "self_draft", "num_speculative_tokens": 2, "draft_layers": 3},
}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_model("llama", tmp_path_factory.mktemp("target"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory) -> Path:
    """The target with noise on every weight: a draft that agrees often, not always."""
    path = tmp_path_factory.mktemp("draft")
    for f in target_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, path / f.name)
    g = torch.Generator().manual_seed(1)
    for f in target_dir.glob("*.safetensors"):
        weights = load_file(f)
        save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in weights.items()}, path / f.name)
    return path


def spec_llm(target_dir, draft_dir, name: str, **overrides) -> LLM:
    spec = {**SPECS[name], **FORCED, **overrides}
    if name == "draft_model":
        spec["model"] = str(draft_dir)
    return LLM(str(target_dir), speculative_config=spec, **BASE)


def mixed_prompts() -> list[list[int]]:
    """Repetitive prompts (n-gram matches), random ones, and a long one that is still prefilling when the
    others verify drafts (the step budget is 40 tokens)."""
    g = torch.Generator().manual_seed(0)
    motif = [11, 12, 13, 14, 15]
    return [motif * 4, [7, 8, 9] * 5 + [20, 21],
            torch.randint(3, 300, (9,), generator=g).tolist(), torch.randint(3, 300, (90,), generator=g).tolist(),
            torch.randint(3, 300, (25,), generator=g).tolist()]


def generate(llm: LLM, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_logprobs_and_kv_equal_plain_decoding(target_dir, draft_dir, name):
    prompts = mixed_prompts()
    extras = [{}, {"repetition_penalty": 1.3, "frequency_penalty": 0.2}, {"logit_bias": {12: 3.0, 13: -2.0}},
              {"presence_penalty": 0.5}, {}]  # penalties and biases apply to p and q alike
    params = [SamplingParams(temperature=0, max_tokens=24 + 3 * i, ignore_eos=True, logprobs=2, **extras[i])
              for i in range(len(prompts))]
    plain_llm = LLM(str(target_dir), **BASE)
    plain = generate(plain_llm, prompts, params)
    llm = spec_llm(target_dir, draft_dir, name)
    spec = generate(llm, prompts, params)
    for a, b in zip(plain, spec, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert list(la) == list(lb)
            assert [x.logprob for x in la.values()] == pytest.approx([x.logprob for x in lb.values()], abs=1e-4)
    stats = llm.engine.stats()
    assert stats.num_drafts > 0 and stats.num_draft_tokens >= stats.num_drafts
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    if name == "draft_model":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # partial acceptance: rollbacks happened
    # the keys and values of every accepted position equal the plain run's (both cached by the prefix cache)
    for p, out in zip(prompts, spec, strict=True):
        tokens = p + out.outputs[0].token_ids
        assert torch.allclose(cached_kv(llm, tokens), cached_kv(plain_llm, tokens), atol=1e-4)
    assert_no_leaks(llm)


def cached_kv(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """The target's keys and values of the prefix-cached full blocks of ``tokens``, all layers stacked."""
    core = llm.engine.core

    class Probe:
        token_ids = tokens

        def __len__(self) -> int:
            return len(tokens)

    block_ids, _ = core.block_manager.find_cached_prefix(Probe())
    assert len(block_ids) == (len(tokens) - 1) // core.config.block_size
    layers = core.runner.kv_caches[:len(core.runner.layers)]  # a draft model's pools come after the target's
    return torch.stack([cache[:, block_ids] for cache in layers])


def test_stop_inside_an_accepted_run_cuts_where_plain_decoding_cuts(target_dir, draft_dir):
    prompt = [11, 12, 13, 14, 15] * 4
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain_llm = LLM(str(target_dir), **BASE)
    full = generate(plain_llm, [prompt], greedy)[0].outputs[0].token_ids
    text = plain_llm.get_tokenizer().decode(full[8:10])
    for params in [SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[full[7]]),
                   SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[text.strip() or text])]:
        plain = generate(plain_llm, [prompt], params)[0].outputs[0]
        llm = spec_llm(target_dir, draft_dir, "ngram", num_speculative_tokens=8)
        spec = generate(llm, [prompt], params)[0].outputs[0]
        assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == \
            (plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
        assert llm.engine.stats().num_accepted_tokens > 0
        assert_no_leaks(llm)


@pytest.mark.parametrize("name", ["draft_model", "ngram"])
def test_seeded_requests_give_the_plain_engines_tokens_alone_and_in_a_batch(target_dir, draft_dir, name):
    """A seeded sample draws each position from its own seeded stream and takes the strict test: its tokens are
    exactly those of decoding without speculation, alone or beside other requests (n > 1 included)."""
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True, n=2)
    prompt = mixed_prompts()[0]
    plain = generate(LLM(str(target_dir), **BASE), [prompt], seeded)[0]
    llm = spec_llm(target_dir, draft_dir, name)
    alone = generate(llm, [prompt], seeded)[0]
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (5, 30, 12)]
    batch = generate(llm, [mixed_prompts()[2], prompt, mixed_prompts()[3], prompt], [others[0], seeded, *others[1:]])
    tokens = [[c.token_ids for c in o.outputs] for o in (plain, alone, batch[1])]
    assert tokens[0] == tokens[1] == tokens[2]
    stats = llm.engine.stats()
    assert stats.num_drafts > 0 and (name == "ngram" or stats.num_accepted_tokens > 0)
    assert_no_leaks(llm)


def chi_square_threshold(df: int, z: float = 3.09) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom (Wilson-Hilferty)."""
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def test_sampling_keeps_the_target_distribution_after_rejections(target_dir, draft_dir):
    """The joint distribution of the first three tokens (top-3 each, temperature 1.5) with a draft model and
    rejection sampling equals the target's exact one: tokens 2 and 3 are verified drafts or drawn after a
    rejection."""
    prompt = mixed_prompts()[2]
    params = SamplingParams(temperature=1.5, top_k=3, max_tokens=3, ignore_eos=True)
    exact = exact_joint(LLM(str(target_dir), **BASE), prompt, params)
    llm = spec_llm(target_dir, draft_dir, "draft_model", num_speculative_tokens=2)
    n = 3000
    outs = generate(llm, [prompt] * (n // 100), params.clone(n=100, best_of=100))
    seen = Counter(tuple(c.token_ids) for o in outs for c in o.outputs)
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert set(seen) <= set(exact)
    cells = sorted(exact, key=exact.get)
    chi2, df, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for c in cells:  # pool the rarest cells until each expects at least 5
        pooled_obs, pooled_exp = pooled_obs + seen[c], pooled_exp + exact[c] * n
        if pooled_exp >= 5:
            chi2, df = chi2 + (pooled_obs - pooled_exp) ** 2 / pooled_exp, df + 1
            pooled_obs, pooled_exp = 0, 0.0
    assert df >= 8
    assert chi2 < chi_square_threshold(df), (chi2, df)
    assert_no_leaks(llm)


def exact_joint(llm: LLM, prompt: list[int], params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) of the target under ``params`` (temperature, top-k), from its logits."""
    def step(prefix: list[int]) -> dict[int, float]:
        logits = heron_logits(llm, prefix)[-1] / params.temperature
        top = logits.topk(params.top_k)
        return dict(zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist(), strict=True))

    joint = {(): 1.0}
    for _ in range(params.max_tokens):
        joint = {(*seq, t): p * q for seq, p in joint.items() for t, q in step(prompt + list(seq)).items()}
    return joint


def test_grammar_requests_decode_plainly_beside_speculating_ones(target_dir, draft_dir):
    from heron.sampling_params import GuidedDecodingParams

    guided = SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex="[ab]{4}"))
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = mixed_prompts()[:2]
    plain = generate(LLM(str(target_dir), **BASE), prompts, [guided, greedy])
    llm = spec_llm(target_dir, draft_dir, "ngram")
    spec = generate(llm, prompts, [guided, greedy])
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().num_drafts > 0
    assert_no_leaks(llm)


def test_a_small_pool_preempts_and_recomputes_speculating_sequences(target_dir, draft_dir):
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = generate(LLM(str(target_dir), **BASE), prompts, params)
    llm = LLM(str(target_dir), speculative_config={**SPECS["draft_model"], **FORCED, "model": str(draft_dir)},
              **{**BASE, "num_gpu_blocks_override": 40, "max_model_len": 160})
    spec = generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().num_preemptions > 0
    assert_no_leaks(llm)


def test_the_adaptive_policy_runs_without_a_forced_rule(target_dir):
    """With the cost model deciding (timings vary), the output is still the plain engine's."""
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = generate(LLM(str(target_dir), **BASE), prompts, params)
    llm = LLM(str(target_dir), speculative_config=SPECS["ngram"], **BASE)
    assert [o.outputs[0].token_ids for o in generate(llm, prompts, params)] == \
        [o.outputs[0].token_ids for o in plain]
    assert llm.engine.core.policy.step_times  # calibrated at start
    assert_no_leaks(llm)


def test_a_draft_with_another_vocabulary_is_refused(target_dir, tmp_path):
    other = build_tiny_model("llama", tmp_path / "other", vocab_size=400)
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(str(target_dir), speculative_config={"method": "draft_model", "model": str(other),
                                                 "num_speculative_tokens": 2}, **BASE)


def test_a_failing_proposer_costs_speed_not_requests(target_dir, draft_dir, monkeypatch):
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = generate(LLM(str(target_dir), **BASE), prompts, params)
    llm = spec_llm(target_dir, draft_dir, "draft_model")
    proposer = llm.engine.core.proposer
    real, calls = proposer.propose, []

    def flaky(seqs, limits):
        calls.append(len(seqs))
        if len(calls) % 3 == 0:
            raise RuntimeError("draft forward failed")
        return real(seqs, limits)

    monkeypatch.setattr(proposer, "propose", flaky)
    spec = generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert len(calls) >= 3 and llm.engine.stats().num_drafts > 0
    assert_no_leaks(llm)


def vector_tiles() -> bool:
    from heron.kernels import cpu_kernels

    kernels = cpu_kernels()
    return kernels is not None and kernels.tile_linear_available() and not kernels.tile_linear_amx()


@pytest.mark.skipif(not vector_tiles(), reason="needs tile_linear's AVX-512 BF16 loop (dense bfloat16 rows take "
                                               "it one or many; with AMX a few take the matrix-vector kernel)")
@pytest.mark.parametrize("name", ["draft_model", "self_draft"])
def test_bfloat16_greedy_output_equals_plain_decoding_with_six_row_verifications(target_dir, draft_dir, name):
    """A bfloat16 target verifies 5 drafts + 1 per sequence: each row of those steps must get the bits that the
    plain engine's one-row decode steps give it."""
    prompts = mixed_prompts()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = {**BASE, "dtype": "bfloat16"}
    plain = generate(LLM(str(target_dir), **base), prompts, params)
    spec = {**SPECS[name], **FORCED, "num_speculative_tokens": 5}
    if name == "draft_model":
        spec["model"] = str(draft_dir)
    llm = LLM(str(target_dir), speculative_config=spec, **base)
    out = generate(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats().num_accepted_tokens > 0
    assert_no_leaks(llm)
