"""A chat choice's text as the API returns it: reasoning, content and tool calls split apart, in one message
or as streamed deltas that add up to that message."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from heron.server.protocol import ChatResponseMessage, ChatToolCall, FunctionCall
from heron.server.reasoning import ReasoningParser
from heron.server.tool_parsers import CallDelta, ToolCallStream, ToolParser
from heron.server.tool_parsers.stream import growth


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class OutputParsing:
    """How one request's output is split; with neither parser the text is all content, untouched."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    constrained: bool = False  # a grammar shapes the output from its first token
    max_calls: int | None = None  # None: any number (parallel_tool_calls)

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def split(self, text: str, final: bool = True) -> tuple[str, str]:
        """``(reasoning, rest)`` of the output so far."""
        if self.reasoning is None:
            return "", text
        return self.reasoning.split(text, final, self.constrained)

    def message(self, text: str) -> ChatResponseMessage:
        """The response message of a complete output."""
        if not self.active:
            return ChatResponseMessage(content=text)
        reasoning, content = self.split(text)
        calls = []
        if self.tools is not None:
            content, calls = self.tools.extract(content)
        tool_calls = [ChatToolCall(id=new_tool_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                      for c in calls[:self.max_calls]]
        return ChatResponseMessage(content=content or None, reasoning_content=reasoning or None,
                                   tool_calls=tool_calls)

    def stream(self) -> DeltaStream:
        return DeltaStream(self)


class DeltaStream:
    """One choice's output, streamed: ``feed`` each new piece of text and get the OpenAI deltas it makes."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        self.text = ""
        self.reasoning = ""  # sent so far
        self.content = ""  # sent so far, when there is no tool parser
        self.tools = ToolCallStream(parsing.tools, parsing.max_calls) if parsing.tools else None

    @property
    def called(self) -> bool:
        """Whether a tool call has been sent."""
        return self.tools is not None and bool(self.tools.calls)

    def feed(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas ``text`` (the output's next piece) makes; ``final``: the output is complete."""
        self.text += text
        reasoning, rest = self.parsing.split(self.text, final)
        deltas: list[dict[str, Any]] = []
        if new := growth(self.reasoning, reasoning):
            self.reasoning += new
            deltas.append({"reasoning_content": new})
        calls: list[CallDelta] = []
        if self.tools is not None:
            content, calls = self.tools.update(rest, final)
        else:
            content = growth(self.content, rest)
            self.content += content
        if content:
            deltas.append({"content": content})
        deltas.extend({"tool_calls": [_call_delta(d)]} for d in calls)
        return deltas


def _call_delta(d: CallDelta) -> dict[str, Any]:
    if d.name is not None:  # a call's first delta, as OpenAI sends it
        return {"index": d.index, "id": new_tool_call_id(), "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
    return {"index": d.index, "function": {"arguments": d.arguments}}
