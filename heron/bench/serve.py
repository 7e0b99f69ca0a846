"""The load generator: send a dataset's requests to an endpoint with a given arrival process and concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import aiohttp
import numpy as np
from tqdm import tqdm

from heron.bench.client import RequestConfig, RequestRecord, send_request
from heron.bench.datasets import SampleRequest
from heron.bench.metrics import summarize
from heron.bench.server_metrics import scrape_spec_counters, spec_decode_summary
from heron.errors import ConfigError


@dataclass
class LoadShape:
    """How requests arrive: ``request_rate`` per second (inf: all at once), gamma-shaped by ``burstiness``."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0

    def validate(self) -> None:
        """Reject impossible load shapes."""
        if not self.request_rate > 0:
            raise ConfigError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ConfigError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ConfigError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class RunResult:
    """One run's records, wall time and the most requests it ever had in flight; ``spec_decode``: the server's
    speculative-decoding acceptance over the run (``server_metrics.spec_decode_summary``; empty if unknown)."""

    shape: LoadShape
    records: list[RequestRecord]
    duration_s: float
    peak_in_flight: int
    spec_decode: dict = field(default_factory=dict)

    def to_json(self, slos: dict[str, float] | None = None) -> dict:
        """The run as stored in a result file: its load shape, summary (with the spec-decode fields when the
        server reported them) and every per-request record."""
        rate = self.shape.request_rate
        summary = {**summarize(self.records, self.duration_s, slos), **self.spec_decode}
        return {"max_concurrency": self.shape.max_concurrency,
                "request_rate": rate if math.isfinite(rate) else "inf",
                "burstiness": self.shape.burstiness,
                "peak_in_flight": self.peak_in_flight,
                "summary": summary,
                "requests": [asdict(r) for r in self.records]}


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Send times (seconds from the start) of ``n`` requests: gaps are Gamma(burstiness, 1/(rate*burstiness)).

    The mean gap is ``1/rate`` whatever the burstiness; burstiness 1 is a Poisson process, lower is burstier.
    An infinite rate sends everything at time 0.
    """
    if math.isinf(rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])]) if n else np.zeros(0)


class _InFlight:
    """Counts requests in flight and remembers the peak."""

    def __init__(self) -> None:
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


def _session(limit: int | None) -> aiohttp.ClientSession:
    # a fresh connection per request: reusing keep-alive connections races with servers closing idle ones,
    # which would show up as client-side errors; on loopback a new connection costs well under a millisecond
    connector = aiohttp.TCPConnector(limit=limit or 0, force_close=True)
    return aiohttp.ClientSession(connector=connector, read_bufsize=8 << 20, trust_env=False)


@contextlib.contextmanager
def _frozen_heap() -> Iterator[None]:
    """Keep the objects that exist before a timed run out of the garbage collector's full passes during it. This
    process holds the tokenizer's and its libraries' objects: a full pass over them took 100-300 ms (one inside a
    32-user run's timed window, 2026-12-07), during which the client read none of its streams and took a core
    from a server on the same machine."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


async def run_load(cfg: RequestConfig, requests: list[SampleRequest], shape: LoadShape, tokenizer=None,
                   progress: bool = True, desc: str = "benchmark") -> RunResult:
    """Send ``requests`` following ``shape``; never more than ``shape.max_concurrency`` at once. The server's
    spec-decode counters (``/metrics``) are scraped just before and after, outside the timed window."""
    shape.validate()
    times = arrival_times(len(requests), shape.request_rate, shape.burstiness, shape.seed)
    limit = asyncio.Semaphore(shape.max_concurrency or len(requests) or 1)
    in_flight = _InFlight()
    bar = tqdm(total=len(requests), desc=desc, disable=not progress, unit="req")

    async def one(session: aiohttp.ClientSession, req: SampleRequest) -> RequestRecord:
        async with limit:
            in_flight.enter()
            try:
                return await send_request(session, cfg, req.prompt, req.prompt_len, req.expected_output_len,
                                          start, tokenizer)
            finally:
                in_flight.leave()
                bar.update(1)

    async with _session(shape.max_concurrency) as session:
        counters_before = await scrape_spec_counters(session, cfg)
        with _frozen_heap():
            start = time.perf_counter()
            tasks = []
            for req, at in zip(requests, times, strict=True):
                delay = start + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, req)))
            records = list(await asyncio.gather(*tasks))
            duration = time.perf_counter() - start
        counters_after = await scrape_spec_counters(session, cfg) if counters_before is not None else None
    bar.close()
    return RunResult(shape, records, duration, in_flight.peak, spec_decode_summary(counters_before, counters_after))


async def probe_server(cfg: RequestConfig) -> dict:
    """GET /v1/models; returns the first model entry ({} if the list is empty). Raises ConfigError if unreachable."""
    url = cfg.base_url.rstrip("/") + "/v1/models"
    try:
        async with _session(1) as session, session.get(url, headers=cfg.headers(),
                                                       timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                raise ConfigError(f"{url} answered HTTP {resp.status}: {(await resp.text())[:200]}")
            data = (await resp.json()).get("data") or [{}]
            return data[0]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        raise ConfigError(f"cannot reach the server at {cfg.base_url} ({e!r}); is it running?") from e


async def run_sweep(cfg: RequestConfig, requests: list[SampleRequest], shapes: list[LoadShape], warmup: int = 0,
                    tokenizer=None, progress: bool = True) -> list[RunResult]:
    """Run each load shape on its own slice of ``requests`` (after ``warmup`` unrecorded ones)."""
    per_run = (len(requests) - warmup) // max(len(shapes), 1)
    if per_run < 1:
        raise ConfigError("not enough prompts for the warmup and every sweep point")
    if warmup:
        first = LoadShape(max_concurrency=shapes[0].max_concurrency)
        await run_load(cfg, requests[:warmup], first, tokenizer, progress, desc="warmup")
    results = []
    for i, shape in enumerate(shapes):
        chunk = requests[warmup + i * per_run: warmup + (i + 1) * per_run]
        desc = f"concurrency {shape.max_concurrency or 'unbounded'}"
        results.append(await run_load(cfg, chunk, shape, tokenizer, progress, desc=desc))
    return results
