"""SamplingParams validation: bad values raise InvalidRequestError (a ValueError) naming the parameter."""

from __future__ import annotations

import pytest

from heron.errors import InvalidRequestError
from heron.sampling_params import GuidedDecodingParams, SamplingParams


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(n=0), "n"),
    (dict(n=2, best_of=1), "best_of"),
    (dict(presence_penalty=3), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(stop=["ok", ""]), "stop"),
    (dict(bad_words=[" "]), "bad_words"),
    (dict(seed="7"), "seed"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
])
def test_invalid_values_raise_with_the_param_name(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == param
    assert isinstance(err.value, ValueError)


def test_normalization():
    p = SamplingParams(stop="###", top_k=0, logit_bias={"5": 1}, n=3)
    assert p.stop == ["###"] and p.top_k == -1 and p.logit_bias == {5: 1.0} and p.best_of == 3
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


@pytest.mark.parametrize("kwargs, param", [
    (dict(stop_token_ids=[100]), "stop_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(logit_bias={100: 1.0}), "logit_bias"),
    (dict(logprobs=101), "logprobs"),
])
def test_token_ids_outside_the_vocabulary(kwargs, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs).verify_token_ids(100)
    assert err.value.param == param and "100" in str(err.value)
    SamplingParams(stop_token_ids=[99], logit_bias={0: 1}).verify_token_ids(100)


@pytest.mark.parametrize("kwargs", [
    dict(), dict(json={"type": "object"}, regex="a+"), dict(choice=[]), dict(choice=["a", 1]),
    dict(json="{not json"), dict(json=[1]), dict(regex=""),
])
def test_invalid_guided_params(kwargs):
    with pytest.raises(InvalidRequestError):
        GuidedDecodingParams(**kwargs)


def test_guided_json_string_is_parsed():
    assert GuidedDecodingParams(json='{"type": "integer"}').json == {"type": "integer"}


class CharTokenizer:
    """One token per character; a leading space merges into the first character's token (id + 1000)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if text.startswith(" "):
            return [1000 + ord(text[1])] + [ord(c) for c in text[2:]]
        return [ord(c) for c in text]


def test_update_from_tokenizer_tokenizes_bad_words_with_and_without_space():
    p = SamplingParams(bad_words=["ab", " c"])
    p.update_from_tokenizer(CharTokenizer())
    assert p.bad_words_token_ids == [[97, 98], [1097, 98], [99], [1099]]
    p.verify_token_ids(2000)
    with pytest.raises(InvalidRequestError, match="bad_words"):
        p.verify_token_ids(1000)
