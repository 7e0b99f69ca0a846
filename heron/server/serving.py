"""What the generation endpoints share: the engine, metrics, model name, request logging and token text."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from heron.engine.async_engine import AsyncEngine, RequestStream
from heron.engine.outputs import RequestOutput
from heron.errors import InvalidRequestError
from heron.sampling.sampler import TokenLogprobs
from heron.sampling_params import SamplingParams
from heron.server.metrics import ServerMetrics
from heron.server.protocol import Usage
from heron.server.streaming import merge_streams

logger = logging.getLogger("heron.server")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(finals: list[RequestOutput | None]) -> Usage:
    """Token usage of some requests' final outputs (prompt tokens once per request, all choices' tokens)."""
    done = [f for f in finals if f is not None]
    return Usage.of(sum(len(f.prompt_token_ids) for f in done),
                    sum(len(c.token_ids) for f in done for c in f.outputs))


@dataclass
class Serving:
    """State shared by the endpoints that generate text."""

    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    log_requests: bool = True

    @property
    def tokenizer(self):
        return self.engine.info.tokenizer

    async def open(self, prompts: list[str | list[int]], params: SamplingParams, request_id: str,
                   priority: int = 0, add_special_tokens: bool = True) -> list[RequestStream]:
        """Queue one engine request per prompt; the engine's validation errors are raised here."""
        if params.n > self.engine.config.max_num_seqs:
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
                self._log(out, "finished")
            yield i, out

    def close(self, streams: list[RequestStream]) -> None:
        """Abort whatever is still running (the client left or the handler failed)."""
        for stream in streams:
            if not stream.finished:
                stream.close()
                if stream.last is not None:
                    self._log(stream.last, "aborted")
                elif self.log_requests:
                    logger.info("request %s aborted before its first output", stream.request_id)

    def _log(self, out: RequestOutput, what: str) -> None:
        if not self.log_requests:
            return
        reasons = ",".join(str(c.finish_reason) for c in out.outputs)
        logger.info("request %s %s: prompt_tokens=%d output_tokens=%d finish_reason=%s latency=%.3fs",
                    out.request_id, what, len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs),
                    reasons if what == "finished" else "abort", time.time() - out.metrics.arrival_time)

    def token_text(self, token_id: int) -> str:
        """The text of one token, as logprobs report it."""
        return self.tokenizer.decode([token_id])

    def top_logprobs(self, lp: TokenLogprobs | None) -> dict[str, float] | None:
        return None if lp is None else {self.token_text(t): v for t, v in lp.top}
