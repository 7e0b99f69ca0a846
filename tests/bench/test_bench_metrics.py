"""Summary statistics, goodput and cost arithmetic, checked against hand computations."""

from __future__ import annotations

import pytest

from heron.bench.client import RequestRecord
from heron.bench.cost import cost_per_million, cost_per_million_per_day, cost_rows, cost_table
from heron.bench.metrics import describe, parse_goodput, summarize, tpot
from heron.errors import ConfigError


def _ok(ttft: float, latency: float, tokens: int, itl: list[float] | None = None) -> RequestRecord:
    return RequestRecord(prompt_len=10, expected_output_len=tokens, success=True, ttft=ttft, latency=latency,
                         itl=itl or [], output_tokens=tokens)


def test_describe_percentiles_in_milliseconds():
    d = describe([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d["mean"] == pytest.approx(50.5)
    assert d["median"] == pytest.approx(50.5)
    assert d["p90"] == pytest.approx(90.1)
    assert d["p99"] == pytest.approx(99.01)
    assert d["std"] == pytest.approx(28.866, abs=1e-3)  # population standard deviation, as numpy's and vLLM's
    assert describe([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0}


def test_tpot_excludes_the_first_token():
    assert tpot(_ok(0.1, 1.1, 11)) == pytest.approx(0.1)
    assert tpot(_ok(0.1, 0.1, 1)) is None


def test_summary_counts_failures_only_as_errors():
    failed = RequestRecord(prompt_len=999, expected_output_len=5, ttft=50.0, latency=99.0)
    records = [_ok(0.1, 1.0, 10, [0.1] * 9), _ok(0.3, 2.0, 20, [0.09] * 19), failed.fail("http_500", "x"),
               RequestRecord(1, 1).fail("timeout", "y")]
    s = summarize(records, duration_s=2.0)
    assert (s["completed"], s["failed"]) == (2, 2)
    assert s["errors"] == {"http_500": 1, "timeout": 1}
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 30
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(15.0)
    assert s["total_token_throughput"] == pytest.approx(25.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["e2el_ms"]["median"] == pytest.approx(1500.0)
    assert s["tpot_ms"]["mean"] == pytest.approx(1000 * (0.9 / 9 + 1.7 / 19) / 2)
    assert "request_goodput" not in s


def test_goodput_counts_requests_meeting_every_slo():
    records = [_ok(0.1, 1.0, 10), _ok(0.6, 1.5, 10), _ok(0.2, 5.0, 10)]  # tpot: 100, 100, 533 ms
    s = summarize(records, 2.0, parse_goodput(["ttft:500", "tpot:150"]))
    assert s["good_requests"] == 1
    assert s["request_goodput"] == pytest.approx(0.5)
    assert s["goodput_slos_ms"] == {"ttft": 500.0, "tpot": 150.0}
    assert summarize(records, 2.0, parse_goodput(["e2el:2000"]))["good_requests"] == 2


@pytest.mark.parametrize("bad", [["ttft"], ["foo:3"], ["ttft:abc"], ["tpot:-1"]])
def test_bad_goodput_specs_raise(bad):
    with pytest.raises(ConfigError):
        parse_goodput(bad)


def test_cost_per_million_matches_hand_computation():
    # 3,000 tok/s * 3,600 s = 10.8M tokens per hour; $6.76 / 10.8 = $0.626 per million
    assert cost_per_million(3000, 6.76) == pytest.approx(6.76 / 10.8, rel=1e-9)
    assert round(cost_per_million(3000, 6.76), 2) == 0.63
    # 300M tokens a day at $6.76/h: $162.24 / 300 = $0.5408 per million
    assert cost_per_million_per_day(300e6, 6.76) == pytest.approx(0.5408)
    with pytest.raises(ConfigError):
        cost_per_million(0, 6.76)


def test_cost_rows_and_api_saving():
    result = {"config": {"label": "heron"}, "runs": [
        {"max_concurrency": 32, "summary": {"output_throughput": 3000.0, "input_throughput": 6000.0}}]}
    (row,) = cost_rows(result, 6.76, api_in=5, api_out=15)
    assert row.output_tokens_per_day == pytest.approx(259.2e6)
    assert row.usd_per_m_output == pytest.approx(0.6259, abs=1e-4)
    assert row.usd_per_m_total == pytest.approx(6.76 / (9000 * 3600) * 1e6)
    # the API bills 2 input tokens per output token here: 15 + 2 * 5 = $25 per million output tokens
    assert row.api_usd_per_m_output == pytest.approx(25.0)
    assert row.saving == pytest.approx(1 - 0.6259 / 25, abs=1e-5)
    table = cost_table([row], 6.76)
    assert "| heron | 32 | 3000.0 | 6000.0 | 259.2M | 0.626 |" in table and "97.5%" in table
