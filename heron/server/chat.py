"""POST /v1/chat/completions: render the chat template, generate ``n`` choices, stream or answer whole."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from heron.engine.async_engine import RequestStream
from heron.engine.outputs import CompletionOutput, SampleLogprobs
from heron.errors import InvalidRequestError
from heron.server.http_errors import stream_error
from heron.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from heron.server.serving import Serving, Totals, new_request_id, openai_logprobs, usage_of
from heron.server.streaming import SSE_DONE, EventStreamResponse, sse, wait_for_request


class Chat:
    """Serves the chat completions API."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving

    async def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text of ``messages`` under the model's chat template."""
        dicts = [m.to_dict() for m in messages]
        try:
            return await self.serving.engine.apply_chat_template(dicts)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}", param="messages") from e

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        request_id = raw.state.request_id = new_request_id("chatcmpl")
        params = req.to_sampling_params()
        prompt = await self.render(req.messages)
        streams = await self.serving.open([prompt], params, request_id, req.priority, add_special_tokens=False)
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, streams[0], params.n),
                                       on_close=lambda: self.serving.close(streams))
        try:
            final = (await wait_for_request(raw, self.serving.collect(streams)))[0]
        finally:
            self.serving.close(streams)
        num_top = req.top_logprobs or 0
        choices = [ChatChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                              logprobs=self._logprobs(c.token_ids, c.logprobs, num_top) if req.logprobs else None,
                              finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in final.outputs]
        response = ChatCompletionResponse(id=request_id, model=self.serving.model_name, choices=choices,
                                          usage=usage_of([final]))
        return JSONResponse(response.model_dump())

    @staticmethod
    def _logprobs(token_ids: list[int], lps: SampleLogprobs | None, num_top: int) -> ChatLogprobs:
        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        content = [ChatTokenLogprob(**entry(token, logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in top])
                   for token, logprob, top in openai_logprobs(token_ids, lps, num_top)]
        return ChatLogprobs(content=content)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, stream: RequestStream, n: int
                      ) -> AsyncIterator[str]:
        created = int(time.time())
        chunk = self._chunker(request_id, created)
        totals = Totals(1)
        done: set[int] = set()
        try:
            yield sse(chunk([_choice(i, {"role": "assistant", "content": ""}) for i in range(n)]))
            async for _, out in self.serving.outputs([stream]):
                totals.add(0, out)
                choices = [self._delta(c, req) for c in out.outputs
                           if c.index not in done and (c.text or c.finished or (req.logprobs and c.token_ids))]
                done.update(c.index for c in out.outputs if c.finished)
                if choices:
                    yield sse(chunk(choices))
            if req.stream_options and req.stream_options.include_usage:
                yield sse(chunk([], usage_of(totals.finals).model_dump()))
        except Exception as e:  # noqa: BLE001 - the status line is sent: report in-band
            yield sse(stream_error(e, request_id))
        yield SSE_DONE

    def _delta(self, c: CompletionOutput, req: ChatCompletionRequest) -> dict:
        choice = _choice(c.index, {"content": c.text}, c.finish_reason)
        choice["stop_reason"] = c.stop_reason
        if req.logprobs:
            choice["logprobs"] = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0).model_dump()
        return choice

    def _chunker(self, request_id: str, created: int):
        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.serving.model_name, "choices": choices, "usage": usage}

        return chunk


def _choice(index: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}

