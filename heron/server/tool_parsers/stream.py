"""Streaming tool calls: parse the output so far after each delta and send what is new since the last time."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from heron.server.tool_parsers.base import BLANK, ToolCall, ToolParser

logger = logging.getLogger("heron.server")


@dataclass
class CallDelta:
    """News of one call: its name the first time (``arguments`` then empty), later a fragment of arguments."""

    index: int
    name: str | None
    arguments: str


def growth(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent``; empty (and logged) if it is not an extension, which a parser must not
    produce: what was sent cannot be taken back."""
    if now.startswith(sent):
        return now[len(sent):]
    logger.warning("streamed output parse went back on text already sent (%r, now %r); change dropped",
                   sent[-40:], now[-40:])
    return ""


class ToolCallStream:
    """Incremental extraction over one choice's output: ``update(text_so_far, final)`` returns the content and
    call deltas that are new, and at the end they add up to ``parser.extract(text)``."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.content = ""  # sent so far
        self.calls: list[ToolCall] = []  # as sent so far

    def update(self, text: str, final: bool = False) -> tuple[str, list[CallDelta]]:
        parsed = self.parser.parse(text, final)
        # extract() strips the content: leading whitespace is never sent, trailing whitespace only once more
        # text follows it
        content = growth(self.content, parsed.content.strip(BLANK))
        self.content += content
        deltas: list[CallDelta] = []
        for i, call in enumerate(parsed.calls[:self.max_calls]):
            if i == len(self.calls):
                self.calls.append(ToolCall(call.name, ""))
                deltas.append(CallDelta(i, call.name, ""))
            elif call.name != self.calls[i].name:
                logger.warning("streamed tool call %d changed its name from %r to %r", i, self.calls[i].name,
                               call.name)
                continue
            if fragment := growth(self.calls[i].arguments, call.arguments):
                self.calls[i].arguments += fragment
                deltas.append(CallDelta(i, None, fragment))
        return content, deltas
