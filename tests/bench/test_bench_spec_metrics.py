"""``heron bench serve`` reports speculative-decoding acceptance from the server's /metrics counters."""

from __future__ import annotations

import asyncio
import json

import pytest

from heron.bench.client import RequestConfig
from heron.bench.datasets import SampleRequest
from heron.bench.report import format_run
from heron.bench.serve import LoadShape, run_load, run_sweep
from heron.bench.server_metrics import parse_spec_counters, spec_decode_summary
from heron.engine.outputs import EngineStats
from heron.server.metrics import ServerMetrics

from .fake_openai import FakeConfig, FakeOpenAIServer
from .test_bench_cli import cli

FAST = {"ttft_s": 0.0, "itl_s": 0.001}
SPEC_KEYS = {"spec_decode_acceptance_rate", "spec_decode_mean_acceptance_length", "spec_decode_num_drafts",
             "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"}


def _requests(n: int) -> list[SampleRequest]:
    return [SampleRequest(f"w{i} w1", 2, 4) for i in range(n)]


def test_parses_heron_s_own_exposition():
    stats = EngineStats(num_drafts=7, num_draft_tokens=21, num_accepted_tokens=12, accepted_per_position=[6, 4, 2])
    text = ServerMetrics("m", lambda: stats).render().decode()
    assert parse_spec_counters(text) == {"num_drafts": 7, "num_draft_tokens": 21, "num_accepted_tokens": 12}
    # a heron server without speculation still has the counters, at 0: a run over it reports nothing
    zero = parse_spec_counters(ServerMetrics("m", EngineStats).render().decode())
    assert zero == dict.fromkeys(("num_drafts", "num_draft_tokens", "num_accepted_tokens"), 0.0)
    assert spec_decode_summary(zero, zero) == {}


def test_parses_vllm_names_summed_over_engines():
    text = "\n".join(
        f'vllm:spec_decode_{name}_total{{engine="{e}",model_name="m"}} {value + e}'
        for e in (0, 1) for name, value in (("num_drafts", 10), ("num_draft_tokens", 30),
                                            ("num_accepted_tokens", 20))) + "\n"
    assert parse_spec_counters(text) == {"num_drafts": 21, "num_draft_tokens": 61, "num_accepted_tokens": 41}


@pytest.mark.parametrize("text", ["", "<html><body>Not Found</body></html>", "vllm:num_requests_running 3\n",
                                  'vllm:spec_decode_num_drafts_total{model_name="m"} 4\n',  # the others missing
                                  "heron:spec_decode_num_drafts_total{oops 1\n"])
def test_no_counters_or_garbage_gives_none(text):
    assert parse_spec_counters(text) is None


def test_summary_from_deltas():
    before = {"num_drafts": 10.0, "num_draft_tokens": 30.0, "num_accepted_tokens": 12.0}
    after = {"num_drafts": 30.0, "num_draft_tokens": 90.0, "num_accepted_tokens": 57.0}
    assert spec_decode_summary(before, after) == {
        "spec_decode_acceptance_rate": 45 / 60, "spec_decode_mean_acceptance_length": 1 + 45 / 20,
        "spec_decode_num_drafts": 20, "spec_decode_num_draft_tokens": 60, "spec_decode_num_accepted_tokens": 45}
    assert spec_decode_summary(None, after) == {} and spec_decode_summary(before, None) == {}
    assert spec_decode_summary(after, before) == {}  # counters went down: the server restarted


@pytest.mark.parametrize("prefix", ["heron", "vllm"])
def test_run_reports_acceptance_over_its_own_requests(prefix):
    config = FakeConfig(**FAST, metrics_prefix=prefix, spec_drafts_per_request=4, spec_k=3,
                        spec_accepted_per_request=6)
    with FakeOpenAIServer(config) as server:
        cfg = RequestConfig(server.base_url, "fake-model")
        # the warmup's drafts (and those before it) are not the measured runs'
        runs = asyncio.run(run_sweep(cfg, _requests(3 + 2 * 5), [LoadShape(max_concurrency=1),
                                                                 LoadShape(max_concurrency=5)],
                                     warmup=3, progress=False))
    for run in runs:
        assert all(r.success for r in run.records)
        assert run.spec_decode == {"spec_decode_acceptance_rate": 0.5, "spec_decode_mean_acceptance_length": 2.5,
                                   "spec_decode_num_drafts": 20, "spec_decode_num_draft_tokens": 60,
                                   "spec_decode_num_accepted_tokens": 30}
        summary = run.to_json()["summary"]
        assert summary["spec_decode_acceptance_rate"] == 0.5 and summary["completed"] == 5
        report = format_run(run.to_json())
        assert "Speculative decoding" in report and "Acceptance rate (%)" in report
        assert "50.00" in report and "2.50" in report


def test_endpoint_without_metrics_gives_no_spec_fields(fake_server):
    cfg = RequestConfig(fake_server.base_url, "fake-model")
    run = asyncio.run(run_load(cfg, _requests(3), LoadShape(), progress=False))
    assert all(r.success for r in run.records)
    assert run.spec_decode == {}
    assert not SPEC_KEYS & run.to_json()["summary"].keys()
    assert "Speculative decoding" not in format_run(run.to_json())


def test_no_drafts_during_the_run_gives_no_spec_fields():
    with FakeOpenAIServer(FakeConfig(**FAST, metrics_prefix="heron", spec_drafts_per_request=0,
                                     spec_accepted_per_request=0)) as server:
        cfg = RequestConfig(server.base_url, "fake-model")
        run = asyncio.run(run_load(cfg, _requests(2), LoadShape(), progress=False))
    assert all(r.success for r in run.records) and run.spec_decode == {}


def test_serve_command_prints_and_saves_acceptance(tokenizer_dir, tmp_path, capsys):
    out = tmp_path / "spec.json"
    with FakeOpenAIServer(FakeConfig(**FAST, metrics_prefix="vllm", spec_drafts_per_request=2, spec_k=4,
                                     spec_accepted_per_request=3)) as server:
        rc = cli("bench", "serve", "--base-url", server.base_url, "--tokenizer", tokenizer_dir, "--input-len", 8,
                 "--output-len", 4, "--num-prompts", 4, "--save-result", out, "--no-progress")
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Speculative decoding" in printed and "37.50" in printed  # 12 of 32 draft tokens accepted
    summary = json.loads(out.read_text())["runs"][0]["summary"]
    assert summary["spec_decode_acceptance_rate"] == pytest.approx(0.375)
    assert summary["spec_decode_mean_acceptance_length"] == pytest.approx(2.5)
    assert summary["spec_decode_num_drafts"] == 8
