"""Prometheus metrics named like vLLM's, with the ``heron:`` prefix and a ``model_name`` label.

Gauges and counters are read from the engine's stats snapshot at scrape time; latency histograms are observed
by the server as each request's outputs stream past.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from heron.engine.outputs import EngineStats, RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                20.0, 40.0, 80.0)


class _StatsCollector:
    """Exports an ``EngineStats`` snapshot as gauges and counters at each scrape."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.get_stats = get_stats

    def collect(self) -> Iterator[Metric]:
        s = self.get_stats()
        label = [self.model_name]
        gauges = {
            "num_requests_running": ("Requests in the running batch", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache blocks in use (1 = 100%)", s.kv_cache_usage),
            "max_num_requests_running_seen": ("Largest running batch so far", s.max_running_seen),
        }
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", s.prefix_cache_hits),
            "num_preemptions": ("Requests preempted to free KV-cache blocks", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens computed", s.prompt_tokens),
            "generation_tokens": ("Tokens generated", s.generation_tokens),
        }
        for family, metrics in ((GaugeMetricFamily, gauges), (CounterMetricFamily, counters)):
            for name, (doc, value) in metrics.items():
                metric = family(f"heron:{name}", doc, labels=["model_name"])
                metric.add_metric(label, value)
                yield metric
        success = CounterMetricFamily("heron:request_success", "Finished requests by finish reason",
                                      labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "abort", *s.finished_by_reason}):
            success.add_metric([self.model_name, reason], s.finished_by_reason.get(reason, 0))
        yield success
        yield from self._spec_decode(s)

    def _spec_decode(self, s: EngineStats) -> Iterator[Metric]:
        """Speculative-decoding counters, named as vLLM v1's ``vllm:spec_decode_*`` (0 without speculation)."""
        counters = {
            "spec_decode_num_drafts": ("Number of spec decoding drafts (one per sequence and step with drafts)",
                                       s.num_drafts),
            "spec_decode_num_draft_tokens": ("Number of draft tokens", s.num_draft_tokens),
            "spec_decode_num_accepted_tokens": ("Number of accepted tokens", s.num_accepted_tokens),
        }
        for name, (doc, value) in counters.items():
            metric = CounterMetricFamily(f"heron:{name}", doc, labels=["model_name"])
            metric.add_metric([self.model_name], value)
            yield metric
        per_pos = CounterMetricFamily("heron:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position", labels=["model_name", "position"])
        for position, accepted in enumerate(s.accepted_per_position):
            per_pos.add_metric([self.model_name, str(position)], accepted)
        yield per_pos


class ServerMetrics:
    """The server's metric registry; ``render()`` gives the /metrics body."""

    def __init__(self, model_name: str, get_stats: Callable[[], EngineStats]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_StatsCollector(model_name, get_stats))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"heron:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish of a request", _LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduling",
                                    _LATENCY_BUCKETS)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        """A tracker that turns one request's outputs into latency observations."""
        return RequestTracker(self)


class RequestTracker:
    """Observes one request's TTFT, inter-token latency, queue time and end-to-end latency."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.last_token_time: float | None = None

    def observe(self, out: RequestOutput) -> None:
        """Record what changed since the previous output of the same request."""
        m = out.metrics
        new = max((len(c.token_ids) for c in out.outputs), default=0)  # outputs are deltas
        if new > 0 and m.last_token_time is not None:
            if self.last_token_time is None:
                if m.first_token_time is not None:
                    self.metrics.ttft.observe(m.first_token_time - m.arrival_time)
                    self._observe_itl(m.last_token_time - m.first_token_time, new - 1)
            else:
                self._observe_itl(m.last_token_time - self.last_token_time, new)
            self.last_token_time = m.last_token_time
        if out.finished:
            end = m.finished_time or m.last_token_time
            if end is not None:
                self.metrics.e2e.observe(end - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.metrics.queue_time.observe(m.first_scheduled_time - m.arrival_time)

    def _observe_itl(self, elapsed: float, gaps: int) -> None:
        for _ in range(gaps):
            self.metrics.itl.observe(max(elapsed, 0.0) / gaps)
