"""POST /v1/completions: one engine request per prompt, ``n`` choices each, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from heron.engine.async_engine import RequestStream
from heron.engine.outputs import CompletionOutput, RequestOutput, SampleLogprobs
from heron.engine.processor import InputProcessor
from heron.server.http_errors import stream_error
from heron.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from heron.server.serving import Serving, Totals, new_request_id, openai_logprobs, usage_of
from heron.server.streaming import SSE_DONE, EventStreamResponse, sse, wait_for_request


@dataclass
class Echo:
    """What ``echo`` puts before a choice: the prompt's text, and for logprobs its tokens and their logprobs."""

    out: RequestOutput  # the request's output: prompt token ids and prompt logprobs
    text: str
    first_token: str  # the first prompt token's text; nothing predicts it, so it has no logprob


class Completions:
    """Serves the legacy completions API."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        request_id = raw.state.request_id = new_request_id("cmpl")
        params = req.to_sampling_params(self.serving.default_sampling)
        prompts = req.prompts()
        streams = await self.serving.open(prompts, params, request_id, req.priority)
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, prompts, streams, params.n),
                                       on_close=lambda: self.serving.close(streams))
        try:
            finals = await wait_for_request(raw, self.serving.collect(streams))
        finally:
            self.serving.close(streams)
        echoes = [await self._echo(prompt, out) if req.echo else None
                  for prompt, out in zip(prompts, finals, strict=True)]
        choices = [self._choice(req, echoes[i], c, i * params.n) for i, out in enumerate(finals) for c in out.outputs]
        response = CompletionResponse(id=request_id, model=self.serving.model_name, choices=choices,
                                      usage=usage_of(finals))
        return JSONResponse(response.model_dump())

    def _choice(self, req: CompletionRequest, echo: Echo | None, c: CompletionOutput, base: int) -> CompletionChoice:
        text = (echo.text if echo else "") + c.text
        logprobs = self._logprobs(req, echo, c.token_ids, c.logprobs) if req.logprobs is not None else None
        return CompletionChoice(index=base + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    async def _echo(self, prompt: str | list[int], out: RequestOutput) -> Echo:
        """The echo of ``prompt``, decoded on the engine's front-end thread (which owns the tokenizer)."""
        ids = out.prompt_token_ids

        def texts(p: InputProcessor) -> tuple[str, str]:
            return prompt if isinstance(prompt, str) else p.tokenizer.decode(ids), p.tokenizer.decode(ids[:1])

        return Echo(out, *await self.serving.engine.call(texts))

    def _logprobs(self, req: CompletionRequest, echo: Echo | None, token_ids: list[int],
                  lps: SampleLogprobs | None, offset: int = 0) -> CompletionLogprobs:
        """Logprobs of ``token_ids`` (preceded by the prompt's when ``echo`` is given), text offsets from
        ``offset``."""
        entries = openai_logprobs(token_ids, lps, req.logprobs)
        if echo is not None:
            prompt_ids, prompt_lps = echo.out.prompt_token_ids, echo.out.prompt_logprobs or [None]
            first = (echo.first_token, None, None)
            entries = [first, *openai_logprobs(prompt_ids[1:], prompt_lps[1:], req.logprobs), *entries]
        result = CompletionLogprobs()
        for token, logprob, top in entries:
            result.tokens.append(token)
            result.text_offset.append(offset)
            result.token_logprobs.append(logprob)
            result.top_logprobs.append(None if top is None else dict(top))
            offset += len(token)
        return result

    async def _stream(self, req: CompletionRequest, request_id: str, prompts: list[str | list[int]],
                      streams: list[RequestStream], n: int) -> AsyncIterator[str]:
        created = int(time.time())
        sent_text: dict[int, int] = {}  # characters of each choice's completion sent so far
        done: set[int] = set()
        totals = Totals(len(streams))
        try:
            async for i, out in self.serving.outputs(streams):
                totals.add(i, out)
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    if index in done:
                        continue
                    first = index not in sent_text
                    echo = await self._echo(prompts[i], out) if first and req.echo else None
                    text = (echo.text if echo else "") + c.text
                    if not text and not c.finished and not first and not (req.logprobs is not None and c.token_ids):
                        continue
                    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if req.logprobs is not None:
                        choice["logprobs"] = self._logprobs(req, echo, c.token_ids, c.logprobs,
                                                            sent_text.get(index, 0)).model_dump()
                    sent_text[index] = sent_text.get(index, 0) + len(c.text)
                    if c.finished:
                        done.add(index)
                    choices.append(choice)
                if choices:
                    yield sse(self._chunk(request_id, created, choices))
            if req.stream_options and req.stream_options.include_usage:
                yield sse(self._chunk(request_id, created, [], usage_of(totals.finals).model_dump()))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            yield sse(stream_error(e, request_id))
        yield SSE_DONE

    def _chunk(self, request_id: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created, "model": self.serving.model_name,
                "choices": choices, "usage": usage}

