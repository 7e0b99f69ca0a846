"""Server-sent events stay one line per event for every client's line splitting."""

import json

import pytest
from httpx._decoders import LineDecoder

from heron.server.streaming import sse


@pytest.mark.parametrize("text", ["a\x85b", "a\u2028b", "a\u2029b", "plain \u00e9\u4e2d", "tab\tnew\nline\r"])
def test_generated_text_never_splits_an_event_line(text):
    # a random model's tokens can decode to NEL or the Unicode line separators, which JSON leaves as they are;
    # httpx's aiter_lines (like str.splitlines) ends a line at each of them
    lines = [line for line in LineDecoder().decode(sse({"choices": [{"text": text}]})) if line]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: "):]) == {"choices": [{"text": text}]}
