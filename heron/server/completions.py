"""POST /v1/completions: one engine request per prompt, ``n`` choices each, streamed or whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from heron.engine.async_engine import RequestStream
from heron.engine.outputs import CompletionOutput, RequestOutput
from heron.sampling.sampler import TokenLogprobs
from heron.server.http_errors import stream_error
from heron.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from heron.server.serving import Serving, new_request_id, usage_of
from heron.server.streaming import SSE_DONE, EventStreamResponse, sse, wait_for_request


class Completions:
    """Serves the legacy completions API."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def create(self, req: CompletionRequest, raw: Request) -> Response:
        params = req.to_sampling_params()
        request_id = new_request_id("cmpl")
        prompts = req.prompts()
        streams = await self.serving.open(prompts, params, request_id, req.priority)
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, prompts, streams, params.n),
                                       on_close=lambda: self.serving.close(streams))
        try:
            finals = await wait_for_request(raw, self._collect(streams))
        finally:
            self.serving.close(streams)
        choices = [self._choice(req, prompts[i], out, c, i * params.n)
                   for i, out in enumerate(finals) for c in out.outputs]
        response = CompletionResponse(id=request_id, model=self.serving.model_name, choices=choices,
                                      usage=usage_of(finals))
        return JSONResponse(response.model_dump())

    async def _collect(self, streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in self.serving.outputs(streams):
            finals[i] = out
        return finals

    def _choice(self, req: CompletionRequest, prompt: str | list[int], out: RequestOutput, c: CompletionOutput,
                base: int) -> CompletionChoice:
        text, logprobs = c.text, None
        if req.echo:
            text = self._prompt_text(prompt) + text
        if req.logprobs is not None:
            logprobs = self._logprobs(out, c.token_ids, c.logprobs, req.echo)
        return CompletionChoice(index=base + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.serving.tokenizer.decode(prompt)

    def _logprobs(self, out: RequestOutput | None, token_ids: list[int], lps: list[TokenLogprobs] | None,
                  echo: bool, offset: int = 0) -> CompletionLogprobs:
        """Logprobs of ``token_ids`` (preceded by the prompt's when ``echo``), text offsets from ``offset``."""
        entries = list(zip(token_ids, lps or [None] * len(token_ids), strict=False))
        if echo:
            prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
            entries = list(zip(out.prompt_token_ids, prompt_lps, strict=False)) + entries
        result = CompletionLogprobs()
        for token_id, lp in entries:
            token = self.serving.token_text(token_id)
            result.tokens.append(token)
            result.text_offset.append(offset)
            result.token_logprobs.append(None if lp is None else lp.logprob)
            result.top_logprobs.append(self.serving.top_logprobs(lp))
            offset += len(token)
        return result

    async def _stream(self, req: CompletionRequest, request_id: str, prompts: list[str | list[int]],
                      streams: list[RequestStream], n: int) -> AsyncIterator[str]:
        created = int(time.time())
        sent_text: dict[int, int] = {}
        sent_tokens: dict[int, int] = {}
        done: set[int] = set()
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in self.serving.outputs(streams):
                finals[i] = out
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    if index in done:
                        continue
                    first = index not in sent_text
                    text = c.text[sent_text.get(index, 0):]
                    if first and req.echo:
                        text = self._prompt_text(prompts[i]) + text
                    if not text and not c.finished and not first:
                        continue
                    choice = {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if req.logprobs is not None:
                        start = sent_tokens.get(index, 0)
                        lps = c.logprobs[start:] if c.logprobs else None
                        choice["logprobs"] = self._logprobs(out, c.token_ids[start:], lps, first and req.echo,
                                                            sent_text.get(index, 0)).model_dump()
                    sent_text[index], sent_tokens[index] = len(c.text), len(c.token_ids)
                    if c.finished:
                        done.add(index)
                    choices.append(choice)
                if choices:
                    yield sse(self._chunk(request_id, created, choices))
            if req.stream_options and req.stream_options.include_usage:
                yield sse(self._chunk(request_id, created, [], usage_of(finals).model_dump()))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            yield sse(stream_error(e))
        yield SSE_DONE

    def _chunk(self, request_id: str, created: int, choices: list[dict], usage: dict | None = None) -> dict:
        return {"id": request_id, "object": "text_completion", "created": created, "model": self.serving.model_name,
                "choices": choices, "usage": usage}

