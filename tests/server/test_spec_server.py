"""The real server with --speculative-config: the same greedy text as without, and the spec-decode counters."""

from __future__ import annotations

import json

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProcess


def spec_counters(url: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            if s.name.startswith("heron:spec_decode"):
                out[s.name + s.labels.get("position", "")] = s.value
    return out


def test_speculating_server_answers_as_the_plain_one(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    prompt = "one two three one two three one two three one two"
    body = {"model": "m", "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    texts = []
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                       "disable_by_batch_size": 64})
    for flags in [(), ("--speculative-config", spec)]:
        with ServerProcess(model, "--served-model-name", "m", *flags, log_path=tmp_path / f"s{len(texts)}.log") as s:
            r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
            counters = spec_counters(s.url)
            if flags:
                assert "speculative decoding: n-gram" in s.log()
    assert texts[0] == texts[1]
    assert counters["heron:spec_decode_num_drafts_total"] > 0
    assert counters["heron:spec_decode_num_draft_tokens_total"] >= counters["heron:spec_decode_num_drafts_total"]
    assert counters["heron:spec_decode_num_accepted_tokens_total"] == sum(
        v for k, v in counters.items() if k.startswith("heron:spec_decode_num_accepted_tokens_per_pos_total"))


def test_a_bad_speculative_config_stops_the_server_with_one_message(tiny_model_dir, tmp_path):
    proc = ServerProcess(tiny_model_dir("llama"), "--speculative-config", '{"method": "medusa"}',
                         log_path=tmp_path / "bad.log")
    code = proc.proc.wait(120)
    assert code != 0
    assert "speculative method 'medusa' is not supported" in proc.log()
    assert "Traceback" not in proc.log()
