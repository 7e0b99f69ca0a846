"""--speculative-config as vLLM reads it, the older flags, and clear errors for what cannot run."""

from __future__ import annotations

import argparse

import pytest

from heron.config import EngineConfig
from heron.errors import ConfigError
from heron.spec_decode.build import draft_layer_ids
from heron.spec_decode.config import SpeculativeConfig


def test_json_and_dict_forms():
    a = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    b = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert a == b and (a.prompt_lookup_min, a.prompt_lookup_max) == (3, 3)  # one given stands for the other
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_max == 5
    assert SpeculativeConfig.parse(None) is None and SpeculativeConfig.parse("") is None


def test_older_flags():
    spec = SpeculativeConfig.parse(None, model="/models/draft", num_tokens=5)
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("draft_model", "/models/draft", 5)
    assert SpeculativeConfig.parse(None, model="[ngram]", num_tokens=3).method == "ngram"


def test_command_line_reaches_the_engine_config():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "self_draft", "num_speculative_tokens": 3}'])
    spec = EngineConfig.from_cli_args(args).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.rejection_sample_method) == ("self_draft", 3,
                                                                                         "probabilistic")


@pytest.mark.parametrize(("spec", "message"), [
    ("{not json", "not valid JSON"),
    ('["ngram"]', "JSON object"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "not supported"),
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"num_speculative_tokens": 3}, "needs a \"method\""),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 16\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": "lossy"}, "rejection_sample_method"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_layers": 3}, "self_draft\" only"),
])
def test_bad_settings_are_one_clear_error(spec, message):
    with pytest.raises(ConfigError, match=message):
        SpeculativeConfig.parse(spec)


def test_pooling_engines_do_not_speculate():
    with pytest.raises(ConfigError, match="pooling"):
        EngineConfig(runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_self_draft_layers_skip_the_middle():
    assert draft_layer_ids(None, 30) == [*range(12), *range(18, 30)]
    assert draft_layer_ids(2, 4) == [0, 3]
    assert draft_layer_ids([3, 0], 4) == [0, 3]
    for bad in (4, 0, [0, 1, 2, 3], [5]):
        with pytest.raises(ConfigError, match="draft_layers"):
            draft_layer_ids(bad, 4)
