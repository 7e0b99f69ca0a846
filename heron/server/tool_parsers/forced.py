"""The output of ``tool_choice: "required"`` or a named function in template mode: the tool grammar forces a
JSON array of ``{"name": ..., "arguments": {...}}`` objects (as vLLM does)."""

from __future__ import annotations

from heron.server.tool_parsers.base import ParsedTools, ToolParser
from heron.server.tool_parsers.json_calls import calls_and_rest, skip_ws


class JsonArrayToolParser(ToolParser):
    """A JSON array of call objects; anything else (only possible if generation was cut short) is content."""

    name = "json_array"

    def parse(self, text: str, final: bool = True) -> ParsedTools:
        start = skip_ws(text, 0)
        if not text.startswith("[", start):
            return ParsedTools(text if final else "")
        calls, rest = calls_and_rest(text, start + 1, final)
        return ParsedTools(rest, calls) if calls or not final else ParsedTools(text)
