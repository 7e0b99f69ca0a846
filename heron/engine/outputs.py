"""What the engine hands back, in vLLM's shapes: RequestOutput, CompletionOutput, Logprob, EmbeddingRequestOutput;
and engine stats."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """vLLM's ``Logprob``: a token's log probability, its rank in the distribution, and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per output token: the sampled token first, then the top ones
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; the first is None (nothing predicts it)


@dataclass
class CompletionOutput:
    """One of a request's ``n`` completions: all of it so far, or what is new (``RequestOutputKind.DELTA``)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life, for latency metrics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    """The state of one request after an engine step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the request failed (finish_reason "error")
    pooled: list[float] | None = None  # a pooling request's vector (runner "pooling"), in its final output

    def add(self, later: RequestOutput) -> None:
        """Fold a later delta output of the same request into this one (as vLLM's ``RequestOutput.add``)."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in mine:
                self.outputs.append(c)
                mine[c.index] = c
                continue
            m = mine[c.index]
            m.text += c.text
            m.token_ids = m.token_ids + c.token_ids
            if c.logprobs is not None:
                m.logprobs = (m.logprobs or []) + c.logprobs
            m.cumulative_logprob = c.cumulative_logprob
            m.finish_reason, m.stop_reason = c.finish_reason, c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished, self.metrics, self.error = later.finished, later.metrics, later.error
        self.prompt_logprobs = later.prompt_logprobs or self.prompt_logprobs
        self.num_cached_tokens = later.num_cached_tokens


@dataclass
class EmbeddingOutput:
    """vLLM's ``EmbeddingOutput``: one prompt's embedding vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput``, what ``LLM.embed`` returns per prompt."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True

    @classmethod
    def of(cls, out: RequestOutput) -> EmbeddingRequestOutput:
        """The embedding of a finished pooling request; raises RuntimeError if the request failed."""
        if out.pooled is None:
            raise RuntimeError(f"request {out.request_id} produced no embedding: {out.error or 'aborted'}")
        return cls(out.request_id, EmbeddingOutput(out.pooled), out.prompt_token_ids, out.finished)


@dataclass
class EngineStats:
    """Counters and gauges the server exports as Prometheus metrics."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_blocks_total: int = 0
    num_blocks_free: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (cache hits excluded)
    generation_tokens: int = 0
    max_running_seen: int = 0
    num_drafts: int = 0  # speculative verifications (one per sequence and step with drafts)
    num_draft_tokens: int = 0  # speculative tokens verified
    num_accepted_tokens: int = 0  # of which accepted
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts accepted at draft position i
    finished_by_reason: dict[str, int] = field(default_factory=dict)
