"""Sampling through heron.LLM on a tiny random model: stop strings, seeds, n > 1, logprobs, structured JSON."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from heron import LLM, SamplingParams
from heron.errors import InvalidRequestError
from heron.sampling_params import GuidedDecodingParams

PROMPT = [5, 77, 120, 33, 250, 9, 41]
SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"type": "string", "enum": ["heron", "egret", "crane", "stork"]},
        "ok": {"type": "boolean"},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 4},
        "nest": {
            "type": "object",
            "properties": {"level": {"type": "string", "enum": ["low", "high"]},
                           "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "bb", "fox"]},
                                    "minItems": 1, "maxItems": 3}},
            "required": ["level", "tags"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "ok", "sizes", "nest"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", device="cpu")


def generate(llm: LLM, prompts: list[list[int]], params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_stop_string_split_across_tokens(llm):
    tok = llm.get_tokenizer()
    out = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
    text = out.text
    # a 4-character stop string whose middle is a token boundary, appearing first at that place
    candidates = []
    for k in range(1, len(out.token_ids)):
        b = len(tok.decode(out.token_ids[:k]))
        if 2 <= b <= len(text) - 2 and text.find(text[b - 2:b + 2]) == b - 2:
            candidates.append(b)
    assert candidates, f"no token boundary to test in {text!r}"
    b = candidates[len(candidates) // 2]
    stop = text[b - 2:b + 2]
    cut = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))
    res = cut[0].outputs[0]
    assert (res.text, res.finish_reason, res.stop_reason) == (text[:b - 2], "stop", stop)
    kept = generate(llm, [PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop],
                                                  include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[:b + 2]


def test_same_seed_same_output_whatever_the_companions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = generate(llm, [PROMPT], seeded)[0].outputs[0].token_ids
    others = [[9, 8, 7, 6], list(range(40, 90)), [300, 301]]
    params = [SamplingParams(temperature=0.7, max_tokens=20, ignore_eos=True), seeded,
              SamplingParams(temperature=1.0, seed=99, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    together = generate(llm, [others[0], PROMPT, others[1], others[2]], params)
    assert together[1].outputs[0].token_ids == alone
    other_seed = generate(llm, [PROMPT], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=12,
                                                        ignore_eos=True))[0].outputs[0].token_ids
    assert other_seed != alone


def test_n_parallel_samples_follow_their_seeds(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    outs = generate(llm, [PROMPT], params)[0].outputs
    assert [o.index for o in outs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs}) == 3
    for i, o in enumerate(outs):  # child i samples with seed + i
        single = SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8, ignore_eos=True)
        assert generate(llm, [PROMPT], single)[0].outputs[0].token_ids == o.token_ids


def test_logprobs_equal_transformers_log_softmax(llm, model_dir):
    params = SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=3, max_tokens=8, ignore_eos=True,
                            logprobs=5, prompt_logprobs=3)
    res = generate(llm, [PROMPT], params)[0]
    out = res.outputs[0]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    full = PROMPT + out.token_ids
    with torch.no_grad():
        raw = torch.log_softmax(ref(torch.tensor([full])).logits[0].float(), dim=-1)
    n = len(PROMPT)
    assert len(out.logprobs) == len(out.token_ids)
    for j, entries in enumerate(out.logprobs):
        dist = raw[n + j - 1]
        token = out.token_ids[j]
        assert next(iter(entries)) == token  # vLLM's order: the sampled token first
        assert entries[token].logprob == pytest.approx(float(dist[token]), abs=1e-4)
        assert entries[token].rank == int((dist > dist[token]).sum()) + 1
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entries.items() if lp.rank <= 5)
        assert [t for _, t, _ in top] == dist.topk(5).indices.tolist()
        assert [v for _, _, v in top] == pytest.approx(dist.topk(5).values.tolist(), abs=1e-4)
        assert all(lp.decoded_token == llm.get_tokenizer().decode([t]) for t, lp in entries.items())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)),
                                                   abs=1e-4)
    assert len(res.prompt_logprobs) == n and res.prompt_logprobs[0] is None
    for i in range(1, n):
        plp = res.prompt_logprobs[i]
        assert next(iter(plp)) == PROMPT[i]
        assert plp[PROMPT[i]].logprob == pytest.approx(float(raw[i - 1, PROMPT[i]]), abs=1e-4)
        top = sorted((lp.rank, t) for t, lp in plp.items() if lp.rank <= 3)
        assert [t for _, t in top] == raw[i - 1].topk(3).indices.tolist()


def test_fifty_structured_outputs_validate(llm):
    # the random model favours whitespace tokens, which free JSON whitespace would let it emit for ever
    # (test_structured.py samples the default, any-whitespace form on random logits)
    guided = GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=300, guided_decoding=guided) for i in range(50)]
    outs = generate(llm, [PROMPT] * 50, params)
    texts = []
    for res in outs:
        out = res.outputs[0]
        assert out.finish_reason == "stop", f"did not finish: {out.text!r}"
        jsonschema.validate(json.loads(out.text), SCHEMA)
        texts.append(out.text)
    assert len(set(texts)) > 40


def test_guided_choice(llm):
    choices = ["red", "green", "blue fox"]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=20,
                             guided_decoding=GuidedDecodingParams(choice=choices)) for i in range(12)]
    texts = [r.outputs[0].text for r in generate(llm, [PROMPT] * 12, params)]
    assert set(texts) <= set(choices) and len(set(texts)) >= 2


def test_bad_words_are_never_generated(llm):
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = generate(llm, [PROMPT], greedy)[0].outputs[0].token_ids
    # a generated token that is a whole word on its own: banning the word bans that token
    word_tokens = [t for t in first if (w := tok.decode([t])).strip() == w and w
                   and tok.encode(w, add_special_tokens=False) == [t]]
    assert word_tokens
    banned = word_tokens[0]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, bad_words=[tok.decode([banned])])
    again = generate(llm, [PROMPT], params)[0].outputs[0].token_ids
    assert banned not in again
    assert again[:first.index(banned)] == first[:first.index(banned)]


@pytest.mark.parametrize("params", [
    dict(logit_bias={10**6: 1.0}),
    dict(allowed_token_ids=[3, 10**6]),
    dict(stop_token_ids=[-1]),
    dict(guided_decoding=GuidedDecodingParams(json={"type": "object", "properties": {"a": {"type": "nope"}}})),
    dict(guided_decoding=GuidedDecodingParams(regex="(unclosed")),
])
def test_invalid_requests_are_rejected_before_running(llm, params):
    queued = set(llm.engine.core.requests)
    with pytest.raises(InvalidRequestError):
        generate(llm, [PROMPT], SamplingParams(**params))
    assert set(llm.engine.core.requests) == queued
