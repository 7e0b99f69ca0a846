"""Tool-call parsers: one module per output format, and the registry ``--tool-call-parser`` chooses from.

``hermes``, ``llama3_json``, ``mistral`` and ``pythonic`` parse what models write freely (``tool_choice:
"auto"``); ``json_array`` and ``generic`` parse what the tool grammar forces (see ``heron/server/tools.py``).
``ToolCallStream`` turns any of them into streamed deltas.
"""

from __future__ import annotations

from heron.server.tool_parsers.base import ParsedTools, ToolCall, ToolParser
from heron.server.tool_parsers.forced import JsonArrayToolParser
from heron.server.tool_parsers.generic import GenericToolParser
from heron.server.tool_parsers.hermes import HermesToolParser
from heron.server.tool_parsers.llama3_json import Llama3JsonToolParser
from heron.server.tool_parsers.mistral import MistralToolParser
from heron.server.tool_parsers.pythonic import PythonicToolParser
from heron.server.tool_parsers.stream import CallDelta, ToolCallStream

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser)}

__all__ = ["TOOL_PARSERS", "CallDelta", "GenericToolParser", "JsonArrayToolParser", "ParsedTools", "ToolCall",
           "ToolCallStream", "ToolParser"]
