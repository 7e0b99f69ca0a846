"""Tool-call parsers: what each format extracts, and that streaming the output cut at every character boundary
adds up to exactly the non-streamed result."""

from __future__ import annotations

import json

import pytest

from heron.server.chat_output import OutputParsing
from heron.server.reasoning import REASONING_PARSERS
from heron.server.tool_parsers import (
    TOOL_PARSERS,
    GenericToolParser,
    JsonArrayToolParser,
    ToolCall,
    ToolCallStream,
    ToolParser,
)
from heron.server.tool_parsers.generic import json_string_prefix
from heron.server.tool_parsers.json_calls import escape_controls


def streamed(parser: ToolParser, text: str, cuts: list[int]) -> tuple[str | None, list[ToolCall]]:
    """What a client reassembles from the deltas of ``text`` fed in pieces ending at ``cuts``."""
    stream = ToolCallStream(parser)
    content, calls, start = "", {}, 0
    for end in [*cuts, len(text)]:
        piece_content, deltas = stream.update(text[:end], final=end == len(text))
        content += piece_content
        for d in deltas:
            if d.name is not None:
                assert d.index == len(calls) and d.arguments == ""
                calls[d.index] = ToolCall(d.name, "")
            else:
                calls[d.index].arguments += d.arguments
        start = end
    assert start == len(text)
    return content or None, list(calls.values())


def assert_streams_like_whole(parser: ToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """Every one-cut split, and the character-by-character stream, reassemble to ``extract(text)``."""
    whole = parser.extract(text)
    assert streamed(parser, text, list(range(1, len(text)))) == whole
    for cut in range(len(text) + 1):
        assert streamed(parser, text, [cut]) == whole, cut
    return whole


HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "}<"}}\n</tool_call>')
CASES = [
    ("hermes", HERMES, "I will check.",
     [ToolCall("get_weather", '{"city": "Paris", "days": [1, 2]}'), ToolCall("add", '{"a": 1, "b": "}<"}')]),
    ("hermes", "Just text, <b>no</b> calls <tool", "Just text, <b>no</b> calls <tool", []),
    ("hermes", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("hermes", '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>', None,
     [ToolCall("late", '{"x": 1}')]),
    ("hermes", '<tool_call>{"name": "cut", "arguments": {"x": "unfinished', None,
     [ToolCall("cut", '{"x": "unfinished')]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "parameters": {"x": 2}}',
     None, [ToolCall("add", '{"a": 1}'), ToolCall("neg", '{"x": 2}')]),
    ("llama3_json", ' {"name": "add", "arguments": {"a": 1}}', None, [ToolCall("add", '{"a": 1}')]),
    ("llama3_json", "The answer is {not a call}", "The answer is {not a call}", []),
    ("llama3_json", '{"no": "name"}', '{"no": "name"}', []),
    ("mistral", 'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"q": [1, {"r": 2}]}}, {"name": "b", "arguments": {}}]',
     "Sure.", [ToolCall("a", '{"q": [1, {"r": 2}]}'), ToolCall("b", "{}")]),
    ("mistral", "[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ("mistral", "No tools [TOOL", "No tools [TOOL", []),
    ("pythonic", '[get_weather(city="Paris, \\"FR\\")", days=[1, 2]), ping(), set(on=True, level=None)]', None,
     [ToolCall("get_weather", '{"city": "Paris, \\"FR\\")", "days": [1, 2]}'), ToolCall("ping", "{}"),
      ToolCall("set", '{"on": true, "level": null}')]),
    ("pythonic", "<|python_start|>[f(a=1)]<|python_end|> done", "done", [ToolCall("f", '{"a": 1}')]),
    ("pythonic", '[f(1), g(b="x")]', '[f(1), g(b="x")]', []),
    ("pythonic", "[1, 2] is a list", "[1, 2] is a list", []),
    ("pythonic", "Hello", "Hello", []),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_extracts_and_streams(name, text, content, calls):
    assert assert_streams_like_whole(TOOL_PARSERS[name](), text) == (content, calls)


def test_arguments_keep_the_text_the_model_wrote():
    text = '<tool_call>{"name": "f", "arguments": {"b": 2,  "a": [ 1 ]}}</tool_call>'
    assert TOOL_PARSERS["hermes"]().extract(text)[1] == [ToolCall("f", '{"b": 2,  "a": [ 1 ]}')]


def test_forced_array_and_generic_formats_stream():
    forced = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "set_alarm", "arguments": {"on": true}}]'
    calls = [ToolCall("add", '{"a": 1, "b": 2}'), ToolCall("set_alarm", '{"on": true}')]
    assert assert_streams_like_whole(JsonArrayToolParser(), forced) == (None, calls)
    assert assert_streams_like_whole(GenericToolParser(), f'{{"tool_calls": {forced}}}') == (None, calls)
    answer = '{"response": "Caf\\u00e9 \\"ok\\"\\n\\ud83d\\ude00 \\\\ done"}'
    assert assert_streams_like_whole(GenericToolParser(), answer) == ('Café "ok"\n😀 \\ done', [])
    assert GenericToolParser().extract('{"response": "cut sh') == ("cut sh", [])


def test_json_string_prefix_waits_for_whole_escapes():
    body = '"a\\u00e9\\ud83d\\ude00\\n"'
    decoded = [json_string_prefix(body[:i], 1) for i in range(1, len(body) + 1)]
    assert decoded[-1] == "aé😀\n"
    assert all(later.startswith(earlier) for earlier, later in zip(decoded, decoded[1:], strict=False))


def test_raw_control_characters_in_strings_are_escaped():
    """xgrammar's length-limited strings allow raw control characters; the arguments must still parse."""
    text = '[{"name": "f", "arguments": {"s": "a\x0fb\tc"}}]'
    [call] = assert_streams_like_whole(JsonArrayToolParser(), text)[1]
    assert json.loads(call.arguments) == {"s": "a\x0fb\tc"}
    assert escape_controls('{"a":\t"x\ty"}') == '{"a":\t"x\\u0009y"}'  # whitespace outside strings is kept


def test_max_calls_keeps_the_first():
    stream = ToolCallStream(JsonArrayToolParser(), max_calls=1)
    _, deltas = stream.update('[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]', final=True)
    assert [d.name for d in deltas if d.name] == ["a"]


def test_reasoning_and_tool_calls_together():
    """qwen3 reasoning first, then hermes calls in the answer: whole and streamed agree."""
    parsing = OutputParsing(REASONING_PARSERS["qwen3"], TOOL_PARSERS["hermes"]())
    text = '<think>\nNeed the weather.\n</think>\n\nOK <tool_call>{"name": "w", "arguments": {"c": 1}}</tool_call>'
    whole = parsing.message(text)
    assert (whole.reasoning_content, whole.content) == ("\nNeed the weather.\n", "OK")
    assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [("w", '{"c": 1}')]
    stream = parsing.stream()
    got = {"reasoning_content": "", "content": "", "calls": {}}
    for i, ch in enumerate(text):
        for delta in stream.feed(ch, final=i == len(text) - 1):
            for key in ("reasoning_content", "content"):
                got[key] += delta.get(key, "")
            for d in delta.get("tool_calls", []):
                got["calls"].setdefault(d["index"], [d["function"].get("name"), ""])[1] += d["function"]["arguments"]
    assert got == {"reasoning_content": whole.reasoning_content, "content": whole.content,
                   "calls": {0: ["w", '{"c": 1}']}}
    assert stream.called
