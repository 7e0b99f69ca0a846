"""Tool calling on the real server with the official openai client: a tiny model whose chat template renders
tools (template mode, hermes parser) and SmolLM2, whose template ignores them (generic mode)."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from helpers import build_tiny_tokenizer

from heron.server.protocol import ChatCompletionRequest
from heron.server.tools import ToolPlan, ToolPlanner, ToolSettings

from .chat_templates import QWEN3_STYLE
from .conftest import ServerProcess

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two small numbers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                       "required": ["a", "b"]}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Switch the alarm on or off",
        "parameters": {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED_ADD = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module", params=["tiny", pytest.param("smollm2", marks=pytest.mark.smollm2)])
def server(request, tmp_path_factory):
    """Template mode (the tiny Qwen3-style server) or generic mode (SmolLM2, auto tool choice on)."""
    if request.param == "tiny":
        yield request.getfixturevalue("qwen3_style_server")
        return
    with ServerProcess(request.getfixturevalue("smollm2_path"), "--served-model-name", "tiny",
                        "--enable-auto-tool-choice", "--max-num-seqs", "64", "--max-model-len", "2048",
                        log_path=tmp_path_factory.mktemp("smollm2-tools") / "server.log", kind="smollm2") as proc:
        yield proc


def client_of(server: ServerProcess) -> openai.OpenAI:
    return server.client(timeout=300)


def chat(server: ServerProcess, **kw):
    return client_of(server).chat.completions.create(model="tiny", messages=kw.pop("messages", USER), **kw)


def assert_valid(call) -> None:
    """A tool call the API returned: OpenAI's shape, a known tool, arguments that match its schema."""
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def reassemble(chunks) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, [(name, arguments)], finish_reason) of a streamed choice, checking each call's deltas are
    shaped as OpenAI sends them: the first has index, id, type, name and empty arguments; later ones only
    argument fragments."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id.startswith("chatcmpl-tool-") and d.type == "function"
                    assert d.function.name and d.function.arguments == ""
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                    calls[d.index][1] += d.function.arguments
            finish = choice.finish_reason or finish
    return content or None, [tuple(c) for _, c in sorted(calls.items())], finish


def test_required_gives_50_valid_calls(server):
    r = chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, n=50, temperature=1.0,
             seed=1, max_tokens=160)
    assert len(r.choices) == 50
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        assert_valid(choice.message.tool_calls[0])


def test_required_parallel_calls_are_each_valid(server):
    r = chat(server, tools=TOOLS, tool_choice="required", n=3, temperature=1.0, seed=2, max_tokens=150)
    for choice in r.choices:
        calls = choice.message.tool_calls
        assert calls and len({c.id for c in calls}) == len(calls)
        assert choice.finish_reason in ("tool_calls", "length")
        finished = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut short
        for call in finished:
            assert_valid(call)


def test_named_tool_choice_calls_that_tool(server):
    r = chat(server, tools=TOOLS, tool_choice=NAMED_ADD, n=5, temperature=1.0, seed=3, max_tokens=100)
    for choice in r.choices:
        assert [c.function.name for c in choice.message.tool_calls] == ["add"]
        assert_valid(choice.message.tool_calls[0])
        assert choice.finish_reason == "tool_calls"


def test_auto_returns_content_or_calls(server):
    r = chat(server, tools=TOOLS, n=6, temperature=1.0, seed=4, max_tokens=40)
    for choice in r.choices:
        calls = choice.message.tool_calls
        if calls:
            assert all(c.function.name in SCHEMAS for c in calls)
            assert choice.finish_reason in ("tool_calls", "length")
        else:  # an answer (None if blank: generic mode's {"response": ""})
            assert isinstance(choice.message.content, str | None) and choice.finish_reason in ("stop", "length")
    assert any(c.message.content or c.message.tool_calls for c in r.choices)


@pytest.mark.parametrize("tool_choice", ["required", NAMED_ADD, "auto"])
def test_streamed_deltas_reassemble_to_whole(server, tool_choice):
    kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=5, max_tokens=60)
    whole = chat(server, **kw).choices[0]
    content, calls, finish = reassemble(chat(server, stream=True, **kw))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == whole.message.content and finish == whole.finish_reason


def test_tool_history_round_trips(server):
    call = {"id": "chatcmpl-tool-1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"sky": "sunny", "celsius": 21}'}]
    r = chat(server, messages=history, tools=TOOLS, tool_choice="none", max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls == [] and r.choices[0].finish_reason in ("stop", "length")
    shorter = chat(server, messages=USER, tools=TOOLS, tool_choice="none", max_tokens=1, temperature=0)
    assert r.usage.prompt_tokens > shorter.usage.prompt_tokens + 15  # the call and its result are in the prompt
    assert ("generic mode" if server.kind == "smollm2" else "template mode") in server.log()


def test_template_mode_renders_tools_as_the_template_does(qwen3_style_server):
    """The prompt of a conversation with tools, a call and its result is the template's own rendering."""
    server = qwen3_style_server
    history = [*USER, {"role": "assistant", "content": "Checking.", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "3"}]
    r = chat(server, messages=history, tools=TOOLS, max_tokens=1, temperature=0)
    hf_history = [*history[:1], {**history[1], "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}, history[2]]
    expected = build_tiny_tokenizer().apply_chat_template(
        hf_history, tools=TOOLS, chat_template=QWEN3_STYLE, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}' in expected and "<tool_response>" in expected
    count = httpx.post(server.url + "/tokenize", json={"prompt": expected, "add_special_tokens": False}).json()
    assert r.usage.prompt_tokens == count["count"]


def test_hermes_calls_parsed_from_free_text(qwen3_style_server):
    """auto in template mode: the hermes parser reads what the model writes (a regex makes the random model
    write a call), whole and streamed."""
    regex = (r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n'
             r'</tool_call>')
    kw = dict(tools=TOOLS, temperature=1.0, seed=6, max_tokens=200, extra_body={"guided_regex": regex})
    whole = chat(qwen3_style_server, **kw).choices[0]
    assert whole.message.content == "Let me check." and whole.finish_reason == "tool_calls"
    [call] = whole.message.tool_calls
    assert call.function.name == "get_weather"
    assert_valid(call)
    content, calls, finish = reassemble(chat(qwen3_style_server, stream=True, **kw))
    assert (content, calls, finish) == ("Let me check.", [("get_weather", call.function.arguments)], "tool_calls")


def nested(depth: int) -> dict:
    """An object schema ``depth`` objects deep (deeper than a grammar may be)."""
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


BAD = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools.0.function.parameters"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED_ADD}, "tool_choice"),
    ({"tools": TOOLS, "parallel_tool_calls": "maybe"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(40)}}], "tool_choice": "required"},
     "tools"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.0"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"type": "code", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages.1.tool_calls.0.type"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "x"}]}, "messages.0"),
    ({"messages": [*USER, {"role": "tool", "content": "3", "tool_call_id": 5}]}, "messages.1.tool_call_id"),
]


@pytest.mark.parametrize("fields,param", BAD)
def test_bad_tool_fields_get_openai_error(qwen3_style_server, fields, param):
    body = {"model": "tiny", "messages": USER, "max_tokens": 5, **fields}
    r = httpx.post(qwen3_style_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and "Traceback" not in error["message"]


def test_serves_after_bad_tool_fields(qwen3_style_server):
    for fields, _ in BAD[:3]:
        httpx.post(qwen3_style_server.url + "/v1/chat/completions", json={"model": "tiny", "messages": USER, **fields})
    r = chat(qwen3_style_server, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0)
    assert r.choices[0].message.tool_calls
    assert httpx.get(qwen3_style_server.url + "/health").status_code == 200


def test_auto_needs_the_flag(fake_server):
    """A server without --enable-auto-tool-choice refuses tool_choice "auto", the default with tools."""
    for extra in ({}, {"tool_choice": "auto"}):
        r = httpx.post(fake_server.url + "/v1/chat/completions", timeout=30,
                       json={"model": "fake", "messages": [{"role": "user", "content": "abc"}], "tools": TOOLS,
                             **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]
    r = httpx.post(fake_server.url + "/v1/chat/completions", timeout=30, json={
        "model": "fake", "messages": [{"role": "user", "content": "abc"}], "tools": TOOLS, "tool_choice": "none",
        "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"] == []


class StubEngine:
    """What ToolPlanner needs of the engine: ``call`` on a processor whose template renders tools or not."""

    def __init__(self, renders_tools: bool) -> None:
        self.renders_tools = renders_tools

    async def call(self, fn):
        renders = self.renders_tools

        class Processor:
            def apply_chat_template(self, messages, tools=None):
                return json.dumps([messages, tools if renders else None])

        return fn(Processor())


def plan_of(renders_tools: bool, **request) -> ToolPlan:
    settings = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")
    req = ChatCompletionRequest(messages=USER, tools=TOOLS, **request)
    return asyncio.run(ToolPlanner(settings, StubEngine(renders_tools)).plan(req))


CALL = {"name": "add", "arguments": {"a": 1, "b": 2}}


@pytest.mark.parametrize("renders_tools,request_fields,good,bad", [
    (True, {"tool_choice": "required"}, [[CALL, CALL]], [[], [{"name": "add", "arguments": {"a": 1}}], CALL]),
    (True, {"tool_choice": "required", "parallel_tool_calls": False}, [[CALL]], [[CALL, CALL]]),
    (True, {"tool_choice": NAMED_ADD}, [[CALL]], [[{"name": "set_alarm", "arguments": {"on": True}}]]),
    (False, {"tool_choice": "required"}, [{"tool_calls": [CALL]}], [{"response": "hi"}, [CALL]]),
    (False, {}, [{"tool_calls": [CALL]}, {"response": "hi"}], [{"response": 1}, {"tool_calls": []}]),
])
def test_plan_grammar(renders_tools, request_fields, good, bad):
    """The grammar's schema takes the calls (and, generic "auto", answers) it should and refuses the rest."""
    plan = plan_of(renders_tools, **request_fields)
    assert plan.generic is not renders_tools
    for value in good:
        jsonschema.validate(value, plan.schema)
    for value in bad:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, plan.schema)


def test_template_auto_uses_the_flagged_parser_and_no_grammar():
    plan = plan_of(True)
    assert (plan.choice, plan.schema, plan.parser.name) == ("auto", None, "hermes")
    assert plan.template_input([{"role": "user", "content": "hi"}]) == ([{"role": "user", "content": "hi"}], TOOLS)


def test_generic_mode_describes_tools_and_rewrites_history():
    plan = plan_of(False, tool_choice=NAMED_ADD)
    history = [{"role": "system", "content": "Be brief."}, *USER,
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
               {"role": "tool", "content": "3", "tool_call_id": "c1"}]
    messages, tools = plan.template_input(history)
    assert tools is None and [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call the following tools.") and 'Call the tool "add"' in system
    assert json.loads(system.split("\n")[3]) == [t["function"] for t in TOOLS]
    assert json.loads(messages[2]["content"]) == {"tool_calls": [CALL]}
    assert json.loads(messages[3]["content"]) == {"tool_response": {"tool_call_id": "c1", "content": "3"}}
    assert plan_of(False, tool_choice="none").template_input(USER) == (USER, None)  # no instructions
