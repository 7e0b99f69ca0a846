"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, once per call,
anywhere in the text."""

from __future__ import annotations

from heron.server.tags import without_partial_tag
from heron.server.tool_parsers.base import ParsedTools, ToolParser
from heron.server.tool_parsers.json_calls import scan_call, skip_ws


class HermesToolParser(ToolParser):
    """Each ``<tool_call>`` block holding a call object is a call; all other text, and a closed block that
    holds no call, is content."""

    name = "hermes"
    needs_special_tokens = True
    start, end = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool = True) -> ParsedTools:
        parsed = ParsedTools("")
        pos = 0
        while (i := text.find(self.start, pos)) >= 0:
            parsed.content += text[pos:i]
            body_start = i + len(self.start)
            j = text.find(self.end, body_start)
            body = text[body_start:j] if j >= 0 else text[body_start:]
            if j < 0 and not final:
                body = without_partial_tag(body, self.end)
            call = scan_call(body, skip_ws(body, 0)).call
            if call is not None:
                parsed.calls.append(call)
            elif j >= 0 or final:  # certainly not a call: it stays text
                parsed.content += text[i:j + len(self.end)] if j >= 0 else text[i:]
            if j < 0:
                return parsed
            pos = j + len(self.end)
        tail = text[pos:]
        parsed.content += tail if final else without_partial_tag(tail, self.start)
        return parsed
