"""heron's generic format, for models whose chat template does not render tools (see docs/tool_calling.md):
the output is one JSON object, ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or
``{"response": "..."}``, which the tool grammar enforces."""

from __future__ import annotations

import json
import re

from heron.server.tool_parsers.base import ParsedTools, ToolParser
from heron.server.tool_parsers.json_calls import calls_and_rest, skip_ws

_CALLS = re.compile(r'\s*\{\s*"tool_calls"\s*:\s*')
_RESPONSE = re.compile(r'\s*\{\s*"response"\s*:\s*"')
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*')
_LENIENT = json.JSONDecoder(strict=False)  # without a grammar a raw newline may stand in a string


class GenericToolParser(ToolParser):
    """``tool_calls`` become calls and ``response`` content; an output in neither shape (only possible if
    generation was cut short) is content as it stands."""

    name = "generic"

    def parse(self, text: str, final: bool = True) -> ParsedTools:
        if m := _CALLS.match(text):
            start = skip_ws(text, m.end())
            if text.startswith("[", start):
                calls, _ = calls_and_rest(text, start + 1, final)
                if calls or not final:
                    return ParsedTools("", calls)
        elif m := _RESPONSE.match(text):
            return ParsedTools(json_string_prefix(text, m.end()))
        return ParsedTools(text if final else "")


def json_string_prefix(text: str, pos: int) -> str:
    """The decoded value of the JSON string whose body starts at ``pos`` (after its opening quote), as far as it
    is written: an escape sequence or surrogate pair cut short is left out until it is complete."""
    body = _STRING_BODY.match(text, pos).group()
    for cut in range(len(body), max(len(body) - 12, -1), -1):  # "\ud83d\ude00" is 12 characters
        try:
            value = _LENIENT.decode(f'"{body[:cut]}"')
        except ValueError:
            continue
        if not (value and "\ud800" <= value[-1] <= "\udbff"):  # a high surrogate waits for its pair
            return value
    return ""
