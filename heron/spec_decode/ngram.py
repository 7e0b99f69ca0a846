"""N-gram speculative proposer: prompt lookup decoding.

The draft for a sequence is read straight out of its own context: the last ``n`` tokens are looked up
earlier in the context (prompt + output), and the tokens that followed that earlier occurrence are
proposed as the next ones. This is vLLM's ``ngram`` speculative method with its knobs
``prompt_lookup_min`` / ``prompt_lookup_max`` (the range of ``n``) and ``num_speculative_tokens``
(``k``, the most tokens proposed). It needs no draft model and no accelerator, and pays off on
inputs the output copies from: code editing, summarising or quoting a document, structured output.

There are no draft probabilities: each draft token is a one-hot "distribution", so the rejection
test reduces to an exact comparison: a draft token is accepted iff the target model's own sample at
that position (drawn with the request's sampling parameters) equals it, and the first mismatch is
replaced by that target sample. The output distribution is therefore exactly the target's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

__all__ = ["NgramProposer", "propose_ngram"]


def _check_params(min_n: int, max_n: int, k: int) -> None:
    """Raise ``ValueError`` unless ``1 <= min_n <= max_n`` and ``k >= 0``."""
    if min_n < 1:
        raise ValueError(f"prompt_lookup_min must be >= 1, got {min_n}")
    if max_n < min_n:
        raise ValueError(f"prompt_lookup_max ({max_n}) must be >= prompt_lookup_min ({min_n})")
    if k < 0:
        raise ValueError(f"the number of speculative tokens must be >= 0, got {k}")


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> np.ndarray:
    """Propose up to ``k`` tokens by looking the context's last n-gram up earlier in the context.

    ``tokens`` is the sequence's whole context (prompt + output) as a 1-D integer array. The match
    length ``n`` is the LONGEST ``n`` in ``[min_n, max_n]`` for which the last ``n`` tokens occur
    earlier in ``tokens``; an occurrence may overlap the suffix but must end before the final
    position (so the suffix itself never matches and at least one token follows every match).
    Among the occurrences of that longest n-gram the EARLIEST (leftmost) one is taken, and the up to
    ``k`` tokens that follow it are returned (fewer when the context ends first).

    This is what vLLM does (``_find_longest_matched_ngram_and_propose_tokens`` in
    ``vllm/v1/spec_decode/ngram_proposer.py``): it runs KMP over the reversed tokens and, on a tie
    in length, moves to the later position in the reversed array "as we want to get the target
    n-gram of the earliest position in the original tokens". The earliest occurrence usually sits
    in the prompt (the document being quoted or edited), it has the most tokens after it, so the
    draft is rarely cut short, and it stays the same from step to step while the output follows it.

    Instead of KMP this compares the candidate end positions against the suffix one offset at a
    time, in numpy: a full pass over the context for the last token, then only the survivors for
    each further token, at most ``max_n`` passes and no Python loop over positions.

    Returns an empty array when no ``n`` in ``[min_n, max_n]`` matches (or ``k == 0``). The result
    is a fresh array (never a view of ``tokens``) with ``tokens``' dtype.
    """
    _check_params(min_n, max_n, k)
    tokens = np.asarray(tokens)
    if tokens.ndim != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
    total = tokens.shape[0]
    empty = np.empty(0, dtype=tokens.dtype)
    if k == 0 or total < max(min_n, 2):
        return empty
    # ``ends`` are the end positions e (index of an occurrence's last token, e <= total - 2) of the
    # occurrences that match the suffix for the first j + 1 tokens; it stays sorted ascending.
    ends = np.flatnonzero(tokens[: total - 1] == tokens[total - 1])
    best_len = 0
    best_end = -1
    if ends.size:
        best_len, best_end = 1, int(ends[0])
    for j in range(1, min(max_n, total - 1)):
        ends = ends[ends >= j]  # an occurrence of length j + 1 needs e - j >= 0
        ends = ends[tokens[ends - j] == tokens[total - 1 - j]]
        if not ends.size:
            break
        best_len, best_end = j + 1, int(ends[0])
    if best_len < min_n:
        return empty
    start = best_end + 1
    return tokens[start : start + k].copy()


class SeqLike(Protocol):
    """What :meth:`NgramProposer.propose` reads from a sequence."""

    seq_id: int
    token_ids: Sequence[int]


class _TokenBuffer:
    """A growable ``np.int64`` copy of one sequence's token ids: ``data[:length]`` is valid."""

    __slots__ = ("data", "length")

    def __init__(self, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        self.data = np.empty(max(16, 2 * n), dtype=np.int64)
        self.data[:n] = token_ids
        self.length = n

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append ``new_ids``, doubling the capacity when it runs out."""
        n = len(new_ids)
        need = self.length + n
        if need > self.data.shape[0]:
            grown = np.empty(max(need, 2 * self.data.shape[0]), dtype=np.int64)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[self.length : need] = new_ids
        self.length = need

    def view(self) -> np.ndarray:
        """The valid tokens (a view, not a copy)."""
        return self.data[: self.length]


class NgramProposer:
    """Prompt-lookup proposer over a batch of sequences, with a per-sequence numpy token cache.

    Converting a sequence's whole token list to numpy every step would cost O(context) Python work
    per sequence per step, so each sequence's tokens are kept in a growable ``np.int64`` buffer,
    keyed by ``seq_id``, and only the tokens appended since the previous call are copied in.

    Token lists are assumed to be append-only between calls. If a list got shorter than the cached
    copy, or its token at the last cached position differs from the cache, the buffer is rebuilt
    from scratch. A caller that rewrites a sequence's tokens in place in any other way must call
    :meth:`forget` for it first.

    The cache holds only the sequences of the latest :meth:`propose` call; the others are dropped
    then, so finished or preempted sequences cannot pile up. :meth:`forget` drops some earlier.
    """

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        _check_params(prompt_lookup_min, prompt_lookup_max, num_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self._buffers: dict[int, _TokenBuffer] = {}

    def _tokens(self, seq: SeqLike) -> np.ndarray:
        """The cached numpy copy of ``seq.token_ids``, brought up to date."""
        token_ids = seq.token_ids
        n = len(token_ids)
        buf = self._buffers.get(seq.seq_id)
        if (
            buf is None
            or n < buf.length
            or (buf.length and int(token_ids[buf.length - 1]) != int(buf.data[buf.length - 1]))
        ):
            buf = self._buffers[seq.seq_id] = _TokenBuffer(token_ids)
        elif n > buf.length:
            buf.extend(token_ids[buf.length : n])
        return buf.view()

    def propose(self, seqs: Iterable[SeqLike], limits: Iterable[int] | None = None) -> dict[int, list[int]]:
        """Draft tokens for each sequence (``seq_id -> tokens``), leaving out those with no match.

        Each draft holds between 1 and ``num_speculative_tokens`` tokens (at most ``limits[i]`` for
        ``seqs[i]`` when given). See :func:`propose_ngram` for which occurrence is used.
        """
        drafts: dict[int, list[int]] = {}
        seen: set[int] = set()
        seqs = list(seqs)
        limits = [self.num_speculative_tokens] * len(seqs) if limits is None else list(limits)
        for seq, limit in zip(seqs, limits, strict=True):
            seen.add(seq.seq_id)
            draft = propose_ngram(
                self._tokens(seq), self.prompt_lookup_min, self.prompt_lookup_max,
                min(limit, self.num_speculative_tokens)
            )
            if draft.size:
                drafts[seq.seq_id] = draft.tolist()
        for seq_id in [s for s in self._buffers if s not in seen]:
            del self._buffers[seq_id]
        return drafts

    def forget(self, seq_ids: Iterable[int]) -> None:
        """Drop the cached tokens of ``seq_ids`` (finished or rewritten sequences); unknown ids are fine."""
        for seq_id in seq_ids:
            self._buffers.pop(seq_id, None)

    def num_cached(self) -> int:
        """How many sequences have a cached token buffer."""
        return len(self._buffers)
