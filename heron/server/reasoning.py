"""Reasoning parsers (``--reasoning-parser``): the text a model writes inside ``<think>...</think>`` goes to
``reasoning_content``, the rest to ``content``, as vLLM's parsers of the same names do.

- ``qwen3``: reasoning only when the output starts with ``<think>`` (Qwen3 with thinking off writes none).
- ``deepseek_r1``: the chat template ends the prompt with ``<think>``, so the output starts inside it:
  everything up to ``</think>`` is reasoning (a ``<think>`` the model writes itself is dropped), all of it if
  ``</think>`` never comes.

An output constrained by a grammar from its first token (structured output, a forced tool call) cannot think
first, so there only an explicit ``<think>`` opens reasoning, for both parsers.
"""

from __future__ import annotations

from dataclasses import dataclass

from heron.server.tags import without_partial_tag


@dataclass(frozen=True)
class ReasoningParser:
    """Splits reasoning from the answer; ``split(text, final=False)`` on an output still being generated holds
    back a tag that may be cut in two, so that each result is a prefix of the next."""

    name: str
    opened_in_prompt: bool  # the output starts inside <think> (the template opened it)
    start: str = "<think>"
    end: str = "</think>"

    def split(self, text: str, final: bool = True, constrained: bool = False) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text``; ``constrained``: a grammar shaped the output from its start."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start):]
        elif not final and self.start.startswith(stripped):
            return "", ""  # nothing yet, or the start tag cut short
        elif self.opened_in_prompt and not constrained:
            body = text
        else:
            return "", text
        end = body.find(self.end)
        if end >= 0:
            return body[:end], body[end + len(self.end):]
        return body if final else without_partial_tag(body, self.end), ""


REASONING_PARSERS = {p.name: p for p in (ReasoningParser("qwen3", opened_in_prompt=False),
                                         ReasoningParser("deepseek_r1", opened_in_prompt=True))}
