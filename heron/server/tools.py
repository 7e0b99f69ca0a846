"""Tool calling on /v1/chat/completions: checking a request's ``tools`` and ``tool_choice``, and planning the
prompt, grammar and output parser that serve them.

There are two modes, chosen once per model by rendering a probe tool:
- **template mode**: the chat template renders tools (it gets them as HF's ``tools=``) and the model answers
  in its own format, which ``--tool-call-parser`` reads;
- **generic mode**: the template ignores tools, so heron describes them in the system prompt in its generic
  JSON format (``generic_tools.py``) and a grammar holds every answer to it.
``tool_choice: "required"`` or a named function is enforced with a grammar in both modes, as vLLM does: a JSON
array of ``{"name": <const>, "arguments": <the tool's parameters schema>}`` objects (in generic mode, inside
``{"tool_calls": ...}``), so every call parses and its arguments match their schema.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Any

from heron.engine.async_engine import AsyncEngine
from heron.errors import InvalidRequestError
from heron.sampling_params import GuidedDecodingParams, SamplingParams
from heron.server.generic_tools import generic_messages, generic_schema, instructions
from heron.server.protocol import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from heron.server.tool_parsers import TOOL_PARSERS, GenericToolParser, JsonArrayToolParser, ToolParser

logger = logging.getLogger("heron.server")

_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_PROBE = "heron_probe_tool"


@dataclass(frozen=True)
class ToolSettings:
    """The server's tool-calling flags."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None  # a TOOL_PARSERS name


@dataclass
class ToolPlan:
    """How one request uses tools: ``choice`` is "none", "auto", "required" or "named" (``function``)."""

    choice: str = "none"
    tools: list[dict[str, Any]] | None = None  # OpenAI's shape, as templates take them
    function: str | None = None
    parallel: bool = True
    generic: bool = False
    parser: ToolParser | None = None  # reads the calls from the output; None: the output is all content
    schema: dict[str, Any] | None = None  # the grammar the output must follow

    @property
    def max_calls(self) -> int | None:
        return None if self.parallel else 1

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the plan's grammar, and special tokens kept if the parser's markers are some."""
        changes: dict[str, Any] = {}
        if self.schema is not None:
            if params.guided_decoding is not None:
                raise InvalidRequestError(f"tool_choice {self.choice!r} is enforced with a grammar here, which "
                                          "cannot be combined with response_format or guided_* fields",
                                          param="tool_choice")
            try:
                changes["guided_decoding"] = GuidedDecodingParams(json=self.schema, disable_any_whitespace=True)
            except InvalidRequestError as e:
                raise unenforceable(e) from e
        if self.parser is not None and self.parser.needs_special_tokens:
            changes["skip_special_tokens"] = False
        return params.clone(**changes) if changes else params

    def template_input(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict] | None]:
        """The messages and tools to render the chat template with."""
        if not self.generic:
            return messages, self.tools
        wanted = self.choice != "none" and self.tools
        text = instructions(self.tools, self.choice, self.function, self.parallel) if wanted else None
        return generic_messages(messages, text), None


def unenforceable(error: InvalidRequestError) -> InvalidRequestError:
    """The error to answer when the grammar built from a request's tools is refused (too large, or it does not
    compile): the tools are at fault, not a guided_json the client never sent."""
    return InvalidRequestError(f"the tools' parameter schemas cannot be enforced: {error}", param="tools")


class ToolPlanner:
    """Checks requests' tool fields and plans them, for one server (its flags and its model's template)."""

    def __init__(self, settings: ToolSettings, engine: AsyncEngine) -> None:
        self.settings = settings
        self.engine = engine
        self._generic: bool | None = None  # the template ignores tools; known after the first probe
        self._probing = asyncio.Lock()

    async def plan(self, req: ChatCompletionRequest) -> ToolPlan:
        """The request's plan; raises InvalidRequestError for a bad tool definition or tool_choice."""
        tools = [_checked(tool, i) for i, tool in enumerate(req.tools or [])]
        choice, function = _choice(req.tool_choice, tools, req.tools is not None)
        history = any(m.tool_calls or m.role == "tool" for m in req.messages)
        if not tools and not history:
            return ToolPlan()
        plan = ToolPlan(choice, tools or None, function, req.parallel_tool_calls, await self._is_generic())
        if choice == "auto":
            self._check_auto(plan.generic)
        if choice == "none":
            return plan
        if choice == "auto" and not plan.generic:
            plan.parser = TOOL_PARSERS[self.settings.tool_call_parser]()
            return plan
        called = [t for t in tools if t["function"]["name"] == function] if function else tools
        calls = calls_schema(called, plan.parallel and not function)
        if plan.generic:
            plan.parser, plan.schema = GenericToolParser(), generic_schema(calls, choice == "auto")
        else:
            plan.parser, plan.schema = JsonArrayToolParser(), calls
        return plan

    def _check_auto(self, generic: bool) -> None:
        s = self.settings
        if generic and not s.enable_auto_tool_choice:
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice to be set',
                                      param="tool_choice")
        if not generic and not (s.enable_auto_tool_choice and s.tool_call_parser):
            raise InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                      "--tool-call-parser to be set", param="tool_choice")

    async def _is_generic(self) -> bool:
        async with self._probing:
            if self._generic is None:
                self._generic = not await self.engine.call(_renders_tools)
                if self._generic:
                    logger.info("tool calling: the chat template does not render tools: generic mode (tools are "
                                "described in the system prompt as JSON; see docs/tool_calling.md)")
                else:
                    logger.info("tool calling: the chat template renders tools: template mode (auto tool choice "
                                "parsed by %s)", self.settings.tool_call_parser or "nothing: no --tool-call-parser")
        return self._generic


def _renders_tools(processor: Any) -> bool:
    """Whether the chat template writes a probe tool's name into the prompt (on the front-end thread)."""
    tool = {"type": "function", "function": {"name": _PROBE, "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        return _PROBE in processor.apply_chat_template([{"role": "user", "content": "hi"}], tools=[tool])
    except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
        return False


def _checked(tool: ToolDefinition, i: int) -> dict[str, Any]:
    """The tool definition as a dict, after the checks pydantic cannot make."""
    fn = tool.function
    if not _NAME.fullmatch(fn.name):
        raise InvalidRequestError(f"tools[{i}].function.name must be 1 to 64 letters, digits, '_', '.', ':' or "
                                  f"'-', got {fn.name!r}", param=f"tools.{i}.function.name")
    if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
        raise InvalidRequestError(f"tools[{i}].function.parameters must be the JSON schema of an object (type "
                                  f"'object'), got type {fn.parameters.get('type')!r}",
                                  param=f"tools.{i}.function.parameters")
    return tool.model_dump(exclude_none=True)


def _choice(tool_choice: str | NamedToolChoice | None, tools: list[dict[str, Any]], tools_given: bool
            ) -> tuple[str, str | None]:
    """``(choice, function)`` of a request; OpenAI's default is "auto" with tools, "none" without."""
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names", param="tools")
    if tool_choice is None:
        return ("auto" if tools else "none"), None
    if tool_choice == "none":
        return "none", None
    if not tools:
        if tool_choice == "required" and tools_given:  # as vLLM: "required" with "tools": [] means "none"
            return "none", None
        raise InvalidRequestError("tool_choice needs tools: this request has none", param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names function {tool_choice.function.name!r}, which is not "
                                      f"among the tools ({', '.join(names)})", param="tool_choice")
        return "named", tool_choice.function.name
    return tool_choice, None


def calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of an array of one (or, ``parallel``, one or more) calls of ``tools``."""
    items = [_call_schema(t["function"]) for t in tools]
    schema = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _call_schema(fn: dict[str, Any]) -> dict[str, Any]:
    arguments = {"type": "object", "properties": {}, **(fn.get("parameters") or {})}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": arguments},
            "required": ["name", "arguments"]}
