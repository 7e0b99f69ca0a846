"""Pythonic tool calls (Llama 3.2, Llama 4): ``[get_weather(city="Paris"), add(a=1, b=2)]``, a Python list of
calls with literal keyword arguments, optionally inside ``<|python_start|>`` ... ``<|python_end|>``."""

from __future__ import annotations

import ast
import json

from heron.server.tags import without_partial_tag
from heron.server.tool_parsers.base import ParsedTools, ToolCall, ToolParser
from heron.server.tool_parsers.json_calls import skip_ws

_OPEN, _CLOSE = "([{", ")]}"


class PythonicToolParser(ToolParser):
    """An output that starts with ``[`` holds calls, each reported once its closing parenthesis is read (its
    arguments are converted to JSON, so they cannot be sent in fragments); any other output is content."""

    name = "pythonic"
    start_tag, end_tag = "<|python_start|>", "<|python_end|>"

    def parse(self, text: str, final: bool = True) -> ParsedTools:
        start = skip_ws(text, 0)
        if text.startswith(self.start_tag, start):
            start = skip_ws(text, start + len(self.start_tag))
        elif not final and self.start_tag.startswith(text[start:]):
            return ParsedTools("")  # nothing yet, or the tag cut short
        if not text.startswith("[", start):
            return ParsedTools(text if final or start < len(text) else "")
        items, end = _list_items(text, start + 1)
        calls: list[ToolCall] = []
        rest = end  # where the content after the calls starts: after the list, or at an item that is no call
        for item_start, item_end in items:
            call = _to_call(text[item_start:item_end])
            if call is None:
                rest = item_start
                break
            calls.append(call)
        if final and not calls:
            return ParsedTools(text)
        if not final and (end is None or rest != end):
            return ParsedTools("", calls)  # what follows is not certain yet
        if rest is None:  # complete, but the list was never closed
            rest = items[-1][1]
        tail = text[rest:]
        if tail.startswith(self.end_tag):
            tail = tail[len(self.end_tag):]
        elif not final:
            tail = without_partial_tag(tail, self.end_tag)
        return ParsedTools(tail, calls)


def _list_items(text: str, pos: int) -> tuple[list[tuple[int, int]], int | None]:
    """The (start, end) of each complete non-blank item of the Python list whose body starts at ``pos``, and the
    index after its closing ``]`` (None if not read yet)."""
    items: list[tuple[int, int]] = []
    depth, quote, start, i = 0, "", pos, pos
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\":
                i += 1
            elif c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c in _OPEN:
            depth += 1
        elif c in _CLOSE and depth:
            depth -= 1
        elif (c == "," and not depth) or c in _CLOSE:
            if text[start:i].strip():
                items.append((start, i))
            if c != ",":
                return items, i + 1
            start = i + 1
        i += 1
    return items, None


def _to_call(source: str) -> ToolCall | None:
    """The call ``name(key=literal, ...)``, or None if ``source`` is not one."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
        if len(args) != len(node.keywords):
            return None
        return ToolCall(node.func.id, json.dumps(args, ensure_ascii=False))
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None
