"""What the generation (and pooling) endpoints share: the engine, metrics, model name, request logging and token
text."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from heron.engine.async_engine import AsyncEngine, RequestStream
from heron.engine.outputs import RequestOutput, SampleLogprobs
from heron.errors import InvalidRequestError
from heron.pooling_params import PoolingParams
from heron.sampling_params import SamplingParams
from heron.server.metrics import ServerMetrics
from heron.server.protocol import Usage
from heron.server.streaming import merge_streams

logger = logging.getLogger("heron.server")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(finals: list[RequestOutput | None]) -> Usage:
    """Token usage of some requests' final outputs (prompt tokens once per request, all choices' tokens, and the
    prompt tokens the prefix cache served)."""
    done = [f for f in finals if f is not None]
    return Usage.of(sum(len(f.prompt_token_ids) for f in done),
                    sum(len(c.token_ids) for f in done for c in f.outputs),
                    sum(f.num_cached_tokens for f in done))


class Totals:
    """Folds the delta outputs of several requests into each one's whole output so far."""

    def __init__(self, num_requests: int) -> None:
        self.finals: list[RequestOutput | None] = [None] * num_requests

    def add(self, i: int, out: RequestOutput) -> None:
        out = dataclasses.replace(out, outputs=[dataclasses.replace(c) for c in out.outputs])  # add() mutates
        if self.finals[i] is None:
            self.finals[i] = out
        else:
            self.finals[i].add(out)


def openai_logprobs(token_ids: list[int], lps: SampleLogprobs | None, num_top: int
                    ) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per token: (text, logprob, the ``num_top`` best (text, logprob) by rank), from vLLM-style logprobs."""
    entries = []
    for token_id, d in zip(token_ids, lps or [], strict=False):
        chosen = d[token_id]
        top = sorted((v for v in d.values() if v.rank is not None and v.rank <= num_top), key=lambda v: v.rank)
        entries.append((chosen.decoded_token, chosen.logprob, [(v.decoded_token, v.logprob) for v in top]))
    return entries


@dataclass
class Serving:
    """State shared by the endpoints that generate text or pool prompts."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    log_requests: bool = True
    default_sampling: dict[str, Any] = field(default_factory=dict)  # the model's generation-config defaults

    async def open(self, prompts: list[str | list[int]], params: SamplingParams | PoolingParams, request_id: str,
                   priority: int = 0, add_special_tokens: bool = True) -> list[RequestStream]:
        """Queue one engine request per prompt; the engine's validation errors are raised here."""
        if isinstance(params, SamplingParams) and params.n > self.engine.config.max_num_seqs:
            raise InvalidRequestError(f"n must be at most --max-num-seqs ({self.engine.config.max_num_seqs}), "
                                      f"got {params.n}", param="n")
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.add_request(prompt, params, rid, priority, add_special_tokens))
        except BaseException:
            self.close(streams)
            raise
        return streams

    async def outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Yield ``(prompt index, output)`` until every stream finishes, recording metrics and request logs."""
        trackers = [self.metrics.tracker() for _ in streams]
        async for i, out in merge_streams(streams):
            trackers[i].observe(out)
            if out.finished:
                self._log(streams[i], "finished")
            yield i, out

    def close(self, streams: list[RequestStream]) -> None:
        """Abort whatever is still running (the client left or the handler failed)."""
        for stream in streams:
            if not stream.finished:
                stream.close()
                if stream.last is not None:
                    self._log(stream, "aborted")
                elif self.log_requests:
                    logger.info("request %s aborted before its first output", stream.request_id)

    def _log(self, stream: RequestStream, what: str) -> None:
        if not self.log_requests:
            return
        out = stream.last
        reasons = ",".join(str(c.finish_reason) for c in out.outputs)
        logger.info("request %s %s: prompt_tokens=%d output_tokens=%d finish_reason=%s latency=%.3fs",
                    out.request_id, what, len(out.prompt_token_ids), stream.num_output_tokens,
                    reasons if what == "finished" else "abort", time.time() - out.metrics.arrival_time)

    async def collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        """Each request's whole output, once all have finished."""
        totals = Totals(len(streams))
        async for i, out in self.outputs(streams):
            totals.add(i, out)
        return totals.finals
