"""Speculative-decoding acceptance of a run, from the server's Prometheus counters scraped before and after it.

heron exports ``heron:spec_decode_num_{drafts,draft_tokens,accepted_tokens}_total`` and vLLM v1 the same names
with the ``vllm:`` prefix. A server without ``/metrics``, or without these counters, or that drafted nothing
during the run, gives no spec-decode fields: scraping never makes a run fail.
"""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from heron.bench.client import RequestConfig

PREFIXES = ("heron:", "vllm:")  # the first whose counters are all present is used
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # spec_decode_<name>_total
SCRAPE_TIMEOUT_S = 10.0


def parse_spec_counters(text: str) -> dict[str, float] | None:
    """The spec-decode counters in a Prometheus text exposition, summed over label sets (engines, models):
    ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens"}``; None unless all three are there."""
    wanted = {f"{prefix}spec_decode_{name}_total": (prefix, name) for prefix in PREFIXES for name in COUNTERS}
    found: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    prefix, name = wanted[sample.name]
                    values = found.setdefault(prefix, {})
                    values[name] = values.get(name, 0.0) + float(sample.value)
    except Exception:  # not a Prometheus exposition (an HTML page, a truncated body): no counters
        return None
    for prefix in PREFIXES:
        if len(found.get(prefix, {})) == len(COUNTERS):
            return found[prefix]
    return None


async def scrape_spec_counters(session: aiohttp.ClientSession, cfg: RequestConfig,
                               timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float] | None:
    """GET ``/metrics`` at the server and parse its spec-decode counters; None on any failure."""
    url = cfg.base_url.rstrip("/") + "/metrics"
    headers = {k: v for k, v in cfg.headers().items() if k != "Content-Type"}
    try:
        async with session.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                return None
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError, UnicodeDecodeError, ValueError):
        return None
    return parse_spec_counters(text)


def spec_decode_summary(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The run's summary fields from counters before and after it: ``spec_decode_acceptance_rate`` (accepted /
    draft tokens, 0..1), ``spec_decode_mean_acceptance_length`` (1 + accepted / drafts, tokens per verification
    as vLLM's bench reports it), ``spec_decode_num_drafts``, ``spec_decode_num_draft_tokens`` and
    ``spec_decode_num_accepted_tokens``. Empty when either scrape failed, nothing was drafted, or a counter went
    down (the server restarted)."""
    if before is None or after is None:
        return {}
    delta = {name: after[name] - before[name] for name in COUNTERS}
    if any(v < 0 for v in delta.values()) or delta["num_draft_tokens"] <= 0 or delta["num_drafts"] <= 0:
        return {}
    drafts, draft_tokens, accepted = (int(round(delta[name])) for name in COUNTERS)
    return {"spec_decode_acceptance_rate": accepted / draft_tokens,
            "spec_decode_mean_acceptance_length": 1.0 + accepted / drafts,
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted}
