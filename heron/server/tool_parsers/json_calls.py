"""Reading ``{"name": ..., "arguments": {...}}`` call objects, alone or in sequences, from text that may stop
anywhere.

The arguments of a call are kept as the model wrote them (the slice of the output holding the value), so that
while streaming every argument fragment sent is final: the non-streamed result is the same text. Only a call
whose ``name`` does not come first is re-serialized, and it is reported once its object is complete. One
repair is made, character by character so that it streams: a raw control character inside a string (which
xgrammar's length-limited strings allow, and strict JSON parsers refuse) is escaped.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from heron.server.tool_parsers.base import ToolCall

_DECODER = json.JSONDecoder(strict=False)  # raw control characters in strings: escaped afterwards
_WS = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?')
_CONTROL = re.compile(r"[\x00-\x1f]")
# An object that starts with its name, up to where its arguments' value begins.
_HEADER = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after ``pos``."""
    return _WS.match(text, pos).end()


@dataclass
class CallScan:
    """What the text holds at one position: a call (possibly unfinished) or not (yet); where its object ends."""

    call: ToolCall | None
    end: int | None  # index after the object, once it is complete


def scan_call(text: str, pos: int) -> CallScan:
    """Read the call object starting at ``text[pos]``."""
    header = _HEADER.match(text, pos)
    try:
        obj, end = _DECODER.raw_decode(text, pos)
    except ValueError:
        obj, end = None, None
    if header is None:
        return CallScan(_from_object(obj) if end is not None else None, end)
    start = header.end()
    try:
        args_end = _DECODER.raw_decode(text, start)[1]
    except ValueError:  # not complete yet: all that follows is part of the value
        args_end = len(text)
    return CallScan(ToolCall(header.group(1), escape_controls(text[start:args_end])), end)


def escape_controls(json_text: str) -> str:
    """``json_text`` with raw control characters inside its strings written as ``\\u00XX`` escapes."""
    if not _CONTROL.search(json_text):
        return json_text
    return _STRING.sub(lambda m: _CONTROL.sub(lambda c: f"\\u{ord(c.group()):04x}", m.group()), json_text)


def _from_object(obj: object) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


@dataclass
class CallSequence:
    """The calls read from a sequence of call objects."""

    calls: list[ToolCall]
    rest: int  # where the text not taken by the calls begins
    closed: bool  # the sequence's closing bracket was read


def scan_calls(text: str, pos: int, sep: str = ",", close: str | None = "]") -> CallSequence:
    """Read call objects separated by ``sep`` from ``pos`` (just after an opening bracket) up to ``close``
    (None: the text's end); stops at the first thing that is not a call."""
    calls: list[ToolCall] = []
    while True:
        start = skip_ws(text, pos)
        if close and text.startswith(close, start):
            return CallSequence(calls, start + len(close), True)
        scan = scan_call(text, start)
        if scan.call is None:
            return CallSequence(calls, start, False)
        calls.append(scan.call)
        if scan.end is None:  # the last call is still being written
            return CallSequence(calls, len(text), False)
        pos = skip_ws(text, scan.end)
        if text.startswith(sep, pos):
            pos += len(sep)
        elif close and text.startswith(close, pos):
            return CallSequence(calls, pos + len(close), True)
        else:
            return CallSequence(calls, pos, False)


def calls_and_rest(text: str, start: int, final: bool, sep: str = ",", close: str | None = "]"
                   ) -> tuple[list[ToolCall], str]:
    """The calls of the sequence at ``start`` and the text after them, which is content once it is certain:
    after the closing bracket, or when the output is complete."""
    seq = scan_calls(text, start, sep, close)
    return seq.calls, text[seq.rest:] if final or seq.closed else ""
