"""Llama 3.1 / 3.2 JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` objects separated by
``;``, optionally after ``<|python_tag|>``."""

from __future__ import annotations

from heron.server.tool_parsers.base import ParsedTools, ToolParser
from heron.server.tool_parsers.json_calls import calls_and_rest, skip_ws


class Llama3JsonToolParser(ToolParser):
    """An output that starts (after whitespace and ``<|python_tag|>``) with ``{`` holds calls; any other is
    content."""

    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool = True) -> ParsedTools:
        start = skip_ws(text, 0)
        if text.startswith(self.tag, start):
            start = skip_ws(text, start + len(self.tag))
        elif not final and self.tag.startswith(text[start:]):
            return ParsedTools("")  # nothing yet, or the tag cut short
        if not text.startswith("{", start):
            return ParsedTools(text if final or start < len(text) else "")
        calls, rest = calls_and_rest(text, start, final, sep=";", close=None)
        return ParsedTools(rest, calls) if calls or not final else ParsedTools(text)
