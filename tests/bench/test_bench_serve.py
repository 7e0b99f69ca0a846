"""The load generator against a fake server with known per-token delays."""

from __future__ import annotations

import asyncio
import gc
import math
import socket

import numpy as np
import pytest

import heron.bench.serve as serve
from heron.bench.client import RequestConfig
from heron.bench.datasets import SampleRequest
from heron.bench.metrics import summarize
from heron.bench.serve import LoadShape, arrival_times, run_load, run_sweep
from heron.errors import ConfigError

from .fake_openai import FakeConfig, FakeOpenAIServer

TTFT, ITL, TOKENS = 0.2, 0.03, 12


def _requests(n: int, tokens: int = TOKENS) -> list[SampleRequest]:
    return [SampleRequest(f"w{i} w1 w2", 3, tokens) for i in range(n)]


def _run(server, n: int, shape: LoadShape, endpoint="/v1/completions", timeout=30.0, tokenizer=None):
    cfg = RequestConfig(server.base_url, "fake-model", endpoint, timeout_s=timeout)
    return asyncio.run(run_load(cfg, _requests(n), shape, tokenizer, progress=False))


def _near_delay(measured_ms: float, delay_s: float) -> bool:
    """A latency measured for a known server delay: never much under it, and a busy machine (CI runs
    several test processes) may lengthen it, but not by half."""
    return 0.95 * delay_s * 1000 <= measured_ms <= 1.5 * delay_s * 1000


def test_measured_latencies_and_throughput_match_known_delays(fake_server):
    result = _run(fake_server, 16, LoadShape(max_concurrency=4))
    s = summarize(result.records, result.duration_s)
    assert s["completed"] == 16 and s["failed"] == 0
    assert _near_delay(s["ttft_ms"]["median"], TTFT), s["ttft_ms"]
    assert _near_delay(s["itl_ms"]["mean"], ITL), s["itl_ms"]
    assert _near_delay(s["tpot_ms"]["median"], ITL), s["tpot_ms"]
    per_request = TTFT + (TOKENS - 1) * ITL
    assert _near_delay(s["e2el_ms"]["median"], per_request), s["e2el_ms"]
    # throughputs are over the run's wall time, which four waves of four cannot beat; a busy machine (the
    # client's scheduling between waves) may only lengthen it
    waves = 16 / 4
    assert waves * per_request * 0.9 <= result.duration_s <= waves * per_request * 2
    assert s["request_throughput"] == pytest.approx(16 / result.duration_s)
    assert s["output_throughput"] == pytest.approx(16 * TOKENS / result.duration_s)
    assert s["total_output_tokens"] == 16 * TOKENS
    assert all(r.output_tokens_source == "usage" for r in result.records)


def test_max_concurrency_is_never_exceeded(fake_server):
    result = _run(fake_server, 12, LoadShape(max_concurrency=3))
    assert fake_server.peak_in_flight == 3
    assert result.peak_in_flight == 3
    unbounded = _run(fake_server, 6, LoadShape())
    assert unbounded.peak_in_flight == 6


def test_sweep_runs_each_concurrency_on_its_own_prompts_after_warmup(fake_server):
    cfg = RequestConfig(fake_server.base_url, "fake-model")
    shapes = [LoadShape(max_concurrency=1), LoadShape(max_concurrency=2)]
    requests = [SampleRequest(f"w{i}", 1, 3) for i in range(2 + 2 * 4)]
    runs = asyncio.run(run_sweep(cfg, requests, shapes, warmup=2, progress=False))
    assert [len(r.records) for r in runs] == [4, 4]
    assert fake_server.received == 10
    assert [b["prompt"] for b in fake_server.bodies[:2]] == ["w0", "w1"]
    assert [r.peak_in_flight for r in runs] == [1, 2]


def test_poisson_arrivals_have_the_right_mean_and_spread():
    gaps = np.diff(arrival_times(20001, rate=5.0, burstiness=1.0, seed=1))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    bursty = np.diff(arrival_times(20001, rate=5.0, burstiness=0.25, seed=1))
    assert bursty.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # gamma: CV = 1/sqrt(shape)
    assert arrival_times(5, math.inf, 1.0, 0).tolist() == [0.0] * 5
    assert arrival_times(50, 5.0, 1.0, 7).tolist() == arrival_times(50, 5.0, 1.0, 7).tolist()


def test_requests_are_sent_on_the_arrival_schedule():
    # no response delay, so each request starts at its scheduled time
    with FakeOpenAIServer(FakeConfig(ttft_s=0.0, itl_s=0.0)) as server:
        result = _run(server, 15, LoadShape(request_rate=40.0, seed=3))
    starts = sorted(r.start for r in result.records)
    expected = arrival_times(15, 40.0, 1.0, 3)
    assert np.allclose(starts, expected, atol=0.05)


@pytest.mark.parametrize("fake_server", [FakeConfig(faults={1: "500", 3: "500", 5: "drop", 7: "hang"}, hang_s=2.0)],
                         indirect=True)
def test_errors_are_counted_by_type_and_kept_out_of_latencies(fake_server):
    result = _run(fake_server, 10, LoadShape(max_concurrency=10), timeout=1.0)
    s = summarize(result.records, result.duration_s)
    assert s["completed"] == 6 and s["failed"] == 4
    assert s["errors"] == {"http_500": 2, "disconnected": 1, "timeout": 1}
    ok = [r for r in result.records if r.success]
    assert s["e2el_ms"]["mean"] == pytest.approx(1000 * sum(r.latency for r in ok) / len(ok))
    assert s["e2el_ms"]["p99"] < 1000  # the hung request is not in the statistics
    assert s["total_output_tokens"] == 6 * TOKENS


def test_unreachable_server_counts_connection_errors():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cfg = RequestConfig(f"http://127.0.0.1:{port}", "m", timeout_s=5)
    result = asyncio.run(run_load(cfg, _requests(3), LoadShape(), progress=False))
    assert summarize(result.records, result.duration_s)["errors"] == {"connection_error": 3}


@pytest.mark.parametrize("fake_server", [FakeConfig(ttft_s=0.0, itl_s=0.0, send_usage=False)], indirect=True)
def test_chat_endpoint_and_tokenizer_counts_without_usage(fake_server, tokenizer):
    result = _run(fake_server, 2, LoadShape(), endpoint="/v1/chat/completions", tokenizer=tokenizer)
    assert fake_server.bodies[0]["messages"] == [{"role": "user", "content": "w0 w1 w2"}]
    assert fake_server.bodies[0]["stream"] is True and fake_server.bodies[0]["ignore_eos"] is True
    for record in result.records:
        assert record.success and record.output_tokens == TOKENS and record.output_tokens_source == "tokenizer"
        assert record.generated_text.split() == [f"w{i}" for i in range(TOKENS)]


def test_bad_load_shapes_are_rejected():
    for shape in (LoadShape(request_rate=0), LoadShape(burstiness=0), LoadShape(max_concurrency=0)):
        with pytest.raises(ConfigError):
            shape.validate()


def test_the_heap_before_a_run_is_frozen_during_it_only(fake_server, monkeypatch):
    """The objects that exist before a timed run stay out of the collector's full passes during it (a pass over
    the client's tokenizer and libraries took 100-280 ms), and are collectable again after it."""
    frozen_while_sending = []

    async def counting(*args, **kwargs):
        frozen_while_sending.append(gc.get_freeze_count())
        return await real(*args, **kwargs)

    real = serve.send_request
    monkeypatch.setattr(serve, "send_request", counting)
    assert gc.get_freeze_count() == 0
    _run(fake_server, 4, LoadShape(max_concurrency=2))
    assert len(frozen_while_sending) == 4 and min(frozen_while_sending) > 0
    assert gc.get_freeze_count() == 0
