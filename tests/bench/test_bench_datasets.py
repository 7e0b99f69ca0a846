"""Benchmark datasets: token lengths, determinism, shared prefixes, ShareGPT parsing."""

from __future__ import annotations

import json

import pytest

from heron.bench.datasets import DatasetSpec, load_sharegpt, sample_requests
from heron.errors import ConfigError


def _count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_have_the_requested_token_lengths(tokenizer):
    reqs = sample_requests(DatasetSpec("random", num_prompts=8, input_len=40, output_len=12), tokenizer)
    assert len(reqs) == 8
    for r in reqs:
        assert r.prompt_len == 40 == _count(tokenizer, r.prompt)
        assert r.expected_output_len == 12
        assert "</s>" not in r.prompt and "[UNK]" not in r.prompt


def test_range_ratio_bounds_and_seed_determinism(tokenizer):
    spec = DatasetSpec("random", num_prompts=50, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    reqs = sample_requests(spec, tokenizer)
    assert all(10 <= r.prompt_len <= 30 and 5 <= r.expected_output_len <= 15 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 5
    assert [r.prompt for r in sample_requests(spec, tokenizer)] == [r.prompt for r in reqs]
    other = sample_requests(DatasetSpec("random", num_prompts=50, input_len=20, range_ratio=0.5, seed=4), tokenizer)
    assert [r.prompt for r in other] != [r.prompt for r in reqs]


def test_prefix_prompts_share_their_prefix(tokenizer):
    spec = DatasetSpec("prefix", num_prompts=6, input_len=8, output_len=4, prefix_len=30, num_prefixes=2)
    reqs = sample_requests(spec, tokenizer)
    heads = [r.prompt.split("\n")[0] for r in reqs]
    assert heads[0] == heads[2] == heads[4] != heads[1] == heads[3] == heads[5]
    assert _count(tokenizer, heads[0]) == 30
    assert all(r.prompt_len == 38 for r in reqs)
    assert len({r.prompt for r in reqs}) == 6


def test_sharegpt_file(tokenizer, tmp_path):
    long = " ".join(["w1"] * 1100)
    data = [{"conversations": [{"from": "human", "value": "w1 w2 w3 w4 w5"}, {"from": "gpt", "value": "w6 w7 w8 w9"}]},
            {"conversations": [{"from": "human", "value": "w1"}, {"from": "gpt", "value": "w2 w3 w4 w5"}]},  # short
            {"conversations": [{"from": "human", "value": long}, {"from": "gpt", "value": "w2 w3 w4 w5"}]},  # long
            {"conversations": [{"from": "human", "value": "only one turn"}]},
            "not a dict"]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    assert len(load_sharegpt(path)) == 3
    reqs = sample_requests(DatasetSpec("sharegpt", num_prompts=3, dataset_path=str(path)), tokenizer)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in reqs] == [("w1 w2 w3 w4 w5", 5, 4)] * 3


@pytest.mark.parametrize("content", ["not json", "{}", "[]"])
def test_bad_sharegpt_files_raise(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ConfigError):
        load_sharegpt(path)


@pytest.mark.parametrize("spec", [DatasetSpec("nope"), DatasetSpec(num_prompts=0), DatasetSpec(range_ratio=1.0),
                                  DatasetSpec("sharegpt"), DatasetSpec("prefix", prefix_len=0)])
def test_bad_specs_raise(spec):
    with pytest.raises(ConfigError):
        spec.validate()


def test_load_tokenizer_resolves_directories_and_rejects_unknown_names(tokenizer_dir, tmp_path):
    from heron.bench.resolve import load_tokenizer, resolve_model_files

    assert load_tokenizer(str(tokenizer_dir)).encode("w3 w4", add_special_tokens=False) == [7, 8]
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    files = resolve_model_files(str(gguf))
    assert (files.directory, files.gguf_file, files.hf_kwargs()) == (tmp_path, "m.gguf", {"gguf_file": "m.gguf"})
    with pytest.raises(ConfigError, match="--tokenizer"):
        resolve_model_files("no-such-model-anywhere")
