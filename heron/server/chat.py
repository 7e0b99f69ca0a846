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
from heron.sampling_params import SamplingParams
from heron.server.chat_output import DeltaStream, OutputParsing
from heron.server.http_errors import stream_error
from heron.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    TopLogprob,
)
from heron.server.reasoning import ReasoningParser
from heron.server.serving import Serving, Totals, new_request_id, openai_logprobs, usage_of
from heron.server.streaming import SSE_DONE, EventStreamResponse, sse, wait_for_request
from heron.server.tools import ToolPlan, ToolPlanner, ToolSettings, unenforceable


class Chat:
    """Serves the chat completions API, with tool calling (``tools.py``) and reasoning output
    (``reasoning.py``); ``chat_output.py`` splits the generated text."""

    def __init__(self, serving: Serving, tool_settings: ToolSettings | None = None,
                 reasoning: ReasoningParser | None = None) -> None:
        self.serving = serving
        self.tools = ToolPlanner(tool_settings or ToolSettings(), serving.engine)
        self.reasoning = reasoning

    async def render(self, messages: list[ChatMessage], plan: ToolPlan | None = None) -> str:
        """The prompt text of ``messages`` (and the tools of ``plan``) under the model's chat template."""
        dicts, tools = (plan or ToolPlan()).template_input([m.to_dict() for m in messages])
        try:
            return await self.serving.engine.apply_chat_template(dicts, tools)
        except jinja2.TemplateError as e:
            raise InvalidRequestError(f"the chat template rejected these messages: {e}", param="messages") from e

    async def create(self, req: ChatCompletionRequest, raw: Request) -> Response:
        request_id = raw.state.request_id = new_request_id("chatcmpl")
        plan = await self.tools.plan(req)
        params = plan.constrain(req.to_sampling_params(self.serving.default_sampling))
        prompt = await self.render(req.messages, plan)
        parsing = OutputParsing(self.reasoning, plan.parser, params.guided_decoding is not None, plan.max_calls)
        streams = await self._open(prompt, params, request_id, req.priority, plan)
        if req.stream:
            return EventStreamResponse(self._stream(req, request_id, streams[0], params.n, parsing),
                                       on_close=lambda: self.serving.close(streams))
        try:
            final = (await wait_for_request(raw, self.serving.collect(streams)))[0]
        finally:
            self.serving.close(streams)
        num_top = req.top_logprobs or 0
        choices = []
        for c in final.outputs:
            message = parsing.message(c.text)
            choices.append(ChatChoice(
                index=c.index, message=message,
                logprobs=self._logprobs(c.token_ids, c.logprobs, num_top) if req.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason, bool(message.tool_calls)), stop_reason=c.stop_reason))
        response = ChatCompletionResponse(id=request_id, model=self.serving.model_name, choices=choices,
                                          usage=usage_of([final]))
        return JSONResponse(response.model_dump())

    async def _open(self, prompt: str, params: SamplingParams, request_id: str, priority: int, plan: ToolPlan
                    ) -> list[RequestStream]:
        try:
            return await self.serving.open([prompt], params, request_id, priority, add_special_tokens=False)
        except InvalidRequestError as e:
            if plan.schema is not None and e.param == "guided_json":  # the grammar heron built from the tools
                raise unenforceable(e) from e
            raise

    @staticmethod
    def _logprobs(token_ids: list[int], lps: SampleLogprobs | None, num_top: int) -> ChatLogprobs:
        def entry(token: str, logprob: float) -> dict:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

        content = [ChatTokenLogprob(**entry(token, logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in top])
                   for token, logprob, top in openai_logprobs(token_ids, lps, num_top)]
        return ChatLogprobs(content=content)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, stream: RequestStream, n: int,
                      parsing: OutputParsing) -> AsyncIterator[str]:
        created = int(time.time())
        chunk = self._chunker(request_id, created)
        totals = Totals(1)
        done: set[int] = set()
        parsed = [parsing.stream() for _ in range(n)] if parsing.active else None
        try:
            yield sse(chunk([_choice(i, {"role": "assistant", "content": ""}) for i in range(n)]))
            async for _, out in self.serving.outputs([stream]):
                totals.add(0, out)
                live = [c for c in out.outputs
                        if c.index not in done and (c.text or c.finished or (req.logprobs and c.token_ids))]
                done.update(c.index for c in out.outputs if c.finished)
                if parsed is None:
                    if live:
                        yield sse(chunk([self._delta(c, req) for c in live]))
                    continue
                for c in live:
                    for choice in self._parsed_deltas(c, req, parsed[c.index]):
                        yield sse(chunk([choice]))  # one chunk each: a header, then fragments
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

    def _parsed_deltas(self, c: CompletionOutput, req: ChatCompletionRequest, stream: DeltaStream) -> list[dict]:
        """The choice entries, one per chunk, of a sample's new output whose text is parsed."""
        deltas = stream.feed(c.text, c.finished)
        if not deltas and not (c.finished or req.logprobs):
            return []  # the text so far is held back (a tag may be starting)
        choices = [_choice(c.index, d) for d in deltas or [{}]]
        if req.logprobs:
            choices[0]["logprobs"] = self._logprobs(c.token_ids, c.logprobs, req.top_logprobs or 0).model_dump()
        if c.finished:
            choices[-1].update(finish_reason=_finish_reason(c.finish_reason, stream.called),
                               stop_reason=c.stop_reason)
        return choices

    def _chunker(self, request_id: str, created: int):
        def chunk(choices: list[dict], usage: dict | None = None) -> dict:
            return {"id": request_id, "object": "chat.completion.chunk", "created": created,
                    "model": self.serving.model_name, "choices": choices, "usage": usage}

        return chunk


def _choice(index: int, delta: dict, finish_reason: str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """A sample that ended normally after calling tools finished with "tool_calls"."""
    return "tool_calls" if called and reason == "stop" else reason

