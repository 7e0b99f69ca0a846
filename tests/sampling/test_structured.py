"""Structured output on random logits: every sampled output follows its JSON schema, regex or choice list."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from helpers import build_tiny_tokenizer

from heron.errors import InvalidRequestError
from heron.sampling.sampler import Sampler, SamplingRow
from heron.sampling.structured import GrammarState, StructuredOutputCompiler
from heron.sampling_params import GuidedDecodingParams, SamplingParams

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["heron", "egret", "crane"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "fox"]}, "maxItems": 3},
        "inner": {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                           "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2}},
            "required": ["n", "flags"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "ok", "tags", "inner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return StructuredOutputCompiler(tokenizer, len(tokenizer), [EOS])


def compile_state(compiler: StructuredOutputCompiler, guided: GuidedDecodingParams) -> GrammarState:
    return GrammarState(compiler.submit(guided).result())


def sample_texts(tokenizer, states: list[GrammarState], max_steps: int = 400, seed: int = 0) -> list[str]:
    """Sample with temperature 1 on random logits until every grammar terminates; return the texts."""
    vocab = len(tokenizer)
    sampler, params = Sampler(vocab, [EOS]), SamplingParams(temperature=1.0)
    outputs: list[list[int]] = [[] for _ in states]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(max_steps):
        live = [i for i, s in enumerate(states) if not s.is_terminated()]
        if not live:
            break
        rows = [SamplingRow(params, [1], outputs[i], None, states[i]) for i in live]
        tokens = sampler(torch.randn(len(live), vocab, generator=gen) * 3, rows).token_ids
        for i, t in zip(live, tokens, strict=True):
            assert states[i].accept_token(t), f"the grammar rejected sampled token {t}"
            outputs[i].append(t)
    assert all(s.is_terminated() for s in states)
    assert all(out[-1] == EOS for out in outputs)
    return [tokenizer.decode(out[:-1]) for out in outputs]


def test_fifty_json_schema_samples_validate(tokenizer, compiler):
    guided = GuidedDecodingParams(json=SCHEMA)
    texts = sample_texts(tokenizer, [compile_state(compiler, guided) for _ in range(50)])
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(set(texts)) > 40  # really sampled, not one forced string


def test_json_without_free_whitespace(tokenizer, compiler):
    guided = GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)
    for text in sample_texts(tokenizer, [compile_state(compiler, guided) for _ in range(10)]):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert text == json.dumps(json.loads(text))  # one space after ':' and ',', nowhere else


def test_json_object_gives_json(tokenizer, compiler):
    guided = GuidedDecodingParams(json_object=True)
    # free JSON has unbounded strings: sample until some finish and check those
    states = [compile_state(compiler, guided) for _ in range(8)]
    vocab, sampler = len(tokenizer), Sampler(len(tokenizer), [EOS])
    outputs: list[list[int]] = [[] for _ in states]
    gen = torch.Generator().manual_seed(0)
    for _ in range(60):
        rows = [SamplingRow(SamplingParams(temperature=0.5), [1], outputs[i], None, s) for i, s in enumerate(states)]
        for i, t in enumerate(sampler(torch.randn(len(states), vocab, generator=gen), rows).token_ids):
            if not states[i].is_terminated():
                assert states[i].accept_token(t)
                outputs[i].append(t)
    text = tokenizer.decode(outputs[0])
    assert text.lstrip()[0] in "{["
    finished = [tokenizer.decode(o[:-1]) for o, s in zip(outputs, states, strict=True) if s.is_terminated()]
    for text in finished:
        json.loads(text)


def test_choice_and_regex(tokenizer, compiler):
    choices = ["yes", "no", 'say "hi"\n', "dog"]
    texts = sample_texts(tokenizer, [compile_state(compiler, GuidedDecodingParams(choice=choices)) for _ in range(30)])
    assert set(texts) <= set(choices) and len(set(texts)) >= 3
    pattern = r"(fox|dog)-[0-9]{2,4}"
    for text in sample_texts(tokenizer, [compile_state(compiler, GuidedDecodingParams(regex=pattern)) for _ in range(10)]):
        assert re.fullmatch(pattern, text)


def test_rows_without_grammar_are_unconstrained(tokenizer, compiler):
    vocab = len(tokenizer)
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(1))
    greedy = SamplingParams(temperature=0)
    state = compile_state(compiler, GuidedDecodingParams(choice=["dog"]))
    rows = [SamplingRow(greedy, [1], [], None), SamplingRow(greedy, [1], [], None, state),
            SamplingRow(greedy, [1], [], None)]
    out = Sampler(vocab, [EOS])(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax()) and out.token_ids[2] == int(logits[2].argmax())
    assert tokenizer.decode([out.token_ids[1]]) in ("d", "do", "dog")


@pytest.mark.parametrize("guided, param", [
    (GuidedDecodingParams(json={"type": "foo"}), "guided_json"),
    (GuidedDecodingParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "guided_json"),
    (GuidedDecodingParams(regex="(ab"), "guided_regex"),
    (GuidedDecodingParams(grammar="root ::= missing"), "guided_grammar"),
])
def test_invalid_constraints_raise_a_clear_error(compiler, guided, param):
    with pytest.raises(InvalidRequestError) as err:
        compiler.submit(guided).result()
    assert err.value.param == param
    assert str(err.value).startswith(f"invalid {param}: ") and ".cc:" not in str(err.value)


def test_compiled_grammars_are_cached_and_states_independent(compiler):
    first = compiler.submit(GuidedDecodingParams(regex="ab|cd")).result()
    again = compiler.submit(GuidedDecodingParams(regex="ab|cd"))
    assert again.done() and again.result() is first
    assert GrammarState(first).matcher is not GrammarState(first).matcher
