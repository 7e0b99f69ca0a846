"""Incremental detokenization and stop-condition checks for one sequence at a time."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from heron.engine.sequence import DetokenizerState, Sequence

_PROMPT_CONTEXT = 6  # prompt tokens decoded alongside the output so the first token gets its spacing right


class Detokenizer:
    """Turns each new token into text without re-decoding the whole output (TGI/vLLM offsets scheme)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def _decode(self, seq: Sequence, ids: list[int]) -> str:
        p = seq.params
        return self.tokenizer.decode(ids, skip_special_tokens=p.skip_special_tokens,
                                     spaces_between_special_tokens=p.spaces_between_special_tokens)

    def append(self, seq: Sequence, token_id: int) -> str:
        """Add ``token_id`` to ``seq``'s text; returns the new text (may be empty while bytes are incomplete)."""
        if seq.detok is None:
            context = seq.request.prompt_token_ids[-_PROMPT_CONTEXT:]
            seq.detok = DetokenizerState(list(context), 0, len(context))
        st = seq.detok
        st.tokens.append(token_id)
        prefix = self._decode(seq, st.tokens[st.prefix_offset:st.read_offset])
        full = self._decode(seq, st.tokens[st.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            st.prefix_offset, st.read_offset = st.read_offset, len(st.tokens)
            st.text += new
            return new
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


def visible_text(seq: Sequence) -> str:
    """Text safe to show now: while running, hold back a tail that could still grow into a stop string."""
    text = seq.detok.text if seq.detok else ""
    if seq.finish_reason is not None or not seq.params.stop:
        return text
    hold = max(len(s) for s in seq.params.stop) - 1
    return text[: len(text) - hold] if hold else text
