"""Summary statistics of a run: throughput, latency percentiles, errors by type, goodput under SLOs.

Definitions follow vLLM's ``benchmark_serving``: TTFT is the time to the first streamed text; TPOT is
``(e2e - ttft) / (output_tokens - 1)`` for requests with more than one output token; ITL is the gap between
successive streamed chunks; goodput counts completed requests meeting every SLO, per second.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from heron.bench.client import RequestRecord
from heron.errors import ConfigError

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "p90", "p99")  # the statistics reports show; summaries also keep "std" (vLLM's)
SLO_KEYS = ("ttft", "tpot", "e2el")


def describe(values_s: Sequence[float]) -> dict[str, float]:
    """Mean, median, standard deviation, p90, p99 (in milliseconds) of values given in seconds; zeros when
    empty."""
    if len(values_s) == 0:
        return dict.fromkeys((*STATS, "std"), 0.0)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p90": float(np.percentile(ms, 90)), "p99": float(np.percentile(ms, 99))}


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first, or None for single-token outputs."""
    if record.output_tokens <= 1:
        return None
    return (record.latency - record.ttft) / (record.output_tokens - 1)


def parse_goodput(items: Sequence[str] | None) -> dict[str, float]:
    """Parse ``["ttft:500", "tpot:50"]`` (milliseconds) into ``{"ttft": 500.0, "tpot": 50.0}``."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_KEYS:
            raise ConfigError(f"bad --goodput item {item!r}; use KEY:MILLISECONDS with KEY in {', '.join(SLO_KEYS)}")
        try:
            slos[key] = float(value)
        except ValueError as e:
            raise ConfigError(f"bad --goodput value in {item!r}: {value!r} is not a number of milliseconds") from e
        if slos[key] <= 0:
            raise ConfigError(f"--goodput {key} must be positive, got {value}")
    return slos


def meets_slos(record: RequestRecord, slos: dict[str, float]) -> bool:
    """Whether a completed request meets every SLO (milliseconds)."""
    values = {"ttft": record.ttft, "tpot": tpot(record) or 0.0, "e2el": record.latency}
    return all(values[key] * 1000.0 <= limit for key, limit in slos.items())


def summarize(records: Sequence[RequestRecord], duration_s: float, slos: dict[str, float] | None = None) -> dict:
    """The summary of one run. Failed requests count only as errors, never in latencies or throughput."""
    ok = [r for r in records if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per = max(duration_s, 1e-9)
    summary = {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": dict(Counter(r.error for r in records if not r.success)),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / per,
        "input_throughput": input_tokens / per,
        "output_throughput": output_tokens / per,
        "total_token_throughput": (input_tokens + output_tokens) / per,
        "ttft_ms": describe([r.ttft for r in ok]),
        "tpot_ms": describe([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": describe([x for r in ok for x in r.itl]),
        "e2el_ms": describe([r.latency for r in ok]),
    }
    if slos:
        good = sum(meets_slos(r, slos) for r in ok)
        summary["goodput_slos_ms"] = dict(slos)
        summary["good_requests"] = good
        summary["request_goodput"] = good / per
    return summary
