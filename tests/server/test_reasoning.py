"""Reasoning output: the parsers on their own (every split of a stream), and the qwen3 parser on the real
server with a tiny Qwen3-style model and the official openai client."""

from __future__ import annotations

import re

import pytest

from heron.server.reasoning import REASONING_PARSERS

SPLITS = [
    ("qwen3", "<think>\nStep 1.\n</think>\n\nParis.", False, ("\nStep 1.\n", "\n\nParis.")),
    ("qwen3", "  <think>a</think>b", False, ("a", "b")),
    ("qwen3", "Paris, no thinking.", False, ("", "Paris, no thinking.")),
    ("qwen3", "<think>cut short by max_tokens", False, ("cut short by max_tokens", "")),
    ("qwen3", "<thin", False, ("", "<thin")),
    ("deepseek_r1", "The prompt opened it.</think>Answer", False, ("The prompt opened it.", "Answer")),
    ("deepseek_r1", "<think>Written again.</think>Answer", False, ("Written again.", "Answer")),
    ("deepseek_r1", "still thinking </thi", False, ("still thinking </thi", "")),
    ("deepseek_r1", '{"json": "from a grammar"}', True, ("", '{"json": "from a grammar"}')),
    ("deepseek_r1", "<think>a</think>b", True, ("a", "b")),
]


@pytest.mark.parametrize("name,text,constrained,expected", SPLITS)
def test_split_whole_and_at_every_boundary(name, text, constrained, expected):
    parser = REASONING_PARSERS[name]
    assert parser.split(text, final=True, constrained=constrained) == expected
    for cut in range(len(text) + 1):
        early = parser.split(text[:cut], final=False, constrained=constrained)
        assert expected[0].startswith(early[0]) and expected[1].startswith(early[1]), (cut, early)


@pytest.fixture(scope="module")
def client(qwen3_style_server):
    return qwen3_style_server.client(timeout=120)


THINK = r"<think>[a-z ]{1,20}</think>[a-z ]{1,12}"  # makes the random model think, then answer


def chat(client, **kw):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Where is Paris?"}],
                                          **kw)


def test_reasoning_content_split_whole_and_streamed(client):
    kw = dict(max_tokens=200, temperature=1.0, seed=11, extra_body={"guided_regex": THINK})
    whole = chat(client, **kw).choices[0]
    assert re.fullmatch(r"[a-z ]{1,20}", whole.message.reasoning_content)
    assert re.fullmatch(r"[a-z ]{1,12}", whole.message.content)
    assert whole.finish_reason == "stop" and whole.message.tool_calls == []
    got = {"reasoning_content": "", "content": ""}
    for chunk in chat(client, stream=True, **kw):
        for choice in chunk.choices:
            got["reasoning_content"] += getattr(choice.delta, "reasoning_content", None) or ""
            got["content"] += choice.delta.content or ""
    assert got == {"reasoning_content": whole.message.reasoning_content, "content": whole.message.content}


def test_output_without_think_is_all_content(client):
    r = chat(client, max_tokens=8, temperature=1.0, seed=12, extra_body={"guided_regex": "[a-z]{8}"})
    assert r.choices[0].message.reasoning_content is None and len(r.choices[0].message.content) == 8
