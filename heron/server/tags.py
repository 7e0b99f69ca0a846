"""Markers in text that is still being generated: a tag may arrive cut in two, so its start is held back."""

from __future__ import annotations


def partial_tag_len(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` may be the start of ``tag`` (0 if none): those must wait for
    the next characters before they can be sent as plain text."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def without_partial_tag(text: str, tag: str) -> str:
    """``text`` less an end that may be the start of ``tag``."""
    return text[:len(text) - partial_tag_len(text, tag)]
