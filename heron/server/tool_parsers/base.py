"""The interface every tool-call parser implements, and the results it returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

BLANK = " \t\r\n"  # what extract() strips around content: whitespace as JSON knows it, not str.strip()'s


@dataclass
class ToolCall:
    """One function call: the function's name and its arguments as JSON text (a prefix of it while the output
    is still being generated)."""

    name: str
    arguments: str


@dataclass
class ParsedTools:
    """A model output split into the text outside the calls and the calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser(ABC):
    """Extracts tool calls from a model's output text, in one model family's format.

    ``parse(text, final=False)`` on an output still being generated returns only what is certain: content
    that cannot turn out to be the start of a call, and calls whose names are known, with their arguments so
    far. Each such result is a prefix of any later one (content and a call's arguments only grow, calls are
    only appended), and of ``parse(whole_text)``: that is what lets ``ToolCallStream`` send differences that
    add up to exactly the non-streamed result.
    """

    name: str = ""
    # Whether the format's markers are special tokens (e.g. Mistral's [TOOL_CALLS]), which detokenization must
    # keep: such a parser turns skip_special_tokens off, as vLLM's do.
    needs_special_tokens: bool = False

    @abstractmethod
    def parse(self, text: str, final: bool = True) -> ParsedTools:
        """The content and calls of ``text``; ``final`` says the output is complete."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The content (None if blank; surrounding whitespace dropped) and the calls of a complete output."""
        parsed = self.parse(text, final=True)
        return parsed.content.strip(BLANK) or None, parsed.calls
