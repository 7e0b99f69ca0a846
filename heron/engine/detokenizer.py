"""Incremental detokenization of one sample (the TGI/vLLM offsets scheme) and stop-string search."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 6  # prompt tokens decoded alongside the output so the first token gets its spacing right


@dataclass
class IncrementalDetokenizer:
    """Turns each new token into text without re-decoding the whole output."""

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    tokens: list[int] = field(default_factory=list)  # a few prompt tokens for context, then the output
    prefix_offset: int = 0
    read_offset: int = 0

    @classmethod
    def for_prompt(cls, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool,
                   spaces_between_special_tokens: bool) -> IncrementalDetokenizer:
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        return cls(tokenizer, skip_special_tokens, spaces_between_special_tokens, context, 0, len(context))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     spaces_between_special_tokens=self.spaces_between_special_tokens)

    def append(self, token_id: int) -> str:
        """Add ``token_id``; returns the new text (empty while a multi-byte character is incomplete)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return full[len(prefix):]
        return ""


def find_stop_string(text: str, new_len: int, stops: list[str]) -> tuple[str, int] | None:
    """The first stop string that ends inside the last ``new_len`` characters of ``text``, and where it starts.

    Only the tail is searched, so a stop string split across tokens is found when its last piece arrives.
    """
    best = None
    for stop in stops:
        start = max(0, len(text) - new_len - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (stop, idx)
    return best
