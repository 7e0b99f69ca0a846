"""Mistral: ``[TOOL_CALLS]`` followed by a JSON array of ``{"name": ..., "arguments": {...}}`` objects."""

from __future__ import annotations

from heron.server.tags import without_partial_tag
from heron.server.tool_parsers.base import ParsedTools, ToolParser
from heron.server.tool_parsers.json_calls import calls_and_rest, skip_ws


class MistralToolParser(ToolParser):
    """Text before ``[TOOL_CALLS]`` is content; the array after it holds the calls."""

    name = "mistral"
    needs_special_tokens = True  # [TOOL_CALLS] is a control token
    tag = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool = True) -> ParsedTools:
        i = text.find(self.tag)
        if i < 0:
            return ParsedTools(text if final else without_partial_tag(text, self.tag))
        start = skip_ws(text, i + len(self.tag))
        calls, rest = calls_and_rest(text, start + 1, final) if text.startswith("[", start) else ([], "")
        if final and not calls:
            return ParsedTools(text)
        return ParsedTools(text[:i] + rest, calls)
