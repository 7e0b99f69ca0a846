"""Core-side state of a request and of the sequences sampling its ``n`` completions.

The core knows only token ids: text, stop strings and detokenization live in the front end. A sequence's
``token_ids`` hold the prompt and the accepted output; ``num_computed_tokens`` of them have keys and values in
the pool. ``spec_token_ids`` are draft tokens to verify in the next step (computed after the last token, never
counted as accepted until verified), with ``spec_probs``, the draft's distributions, when they were sampled
from a draft model; ``num_draft_computed`` counts the positions a draft model has its own keys and values for.

A seeded sample draws its randomness per position (``seed_for``), not from one stream: its tokens are then the
same whatever its batch companions, and whether or not a step verified drafts.

A pooling request (``pooling`` set) has the neutral ``SamplingParams()`` (one sample, no logprobs, no grammar),
so the scheduler's questions about samples need no special case; it is never sampled and ends when its prompt
is computed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, overload

import torch

from heron.engine.pooling import PoolingState
from heron.sampling.sampler import TokenLogprobs
from heron.sampling_params import SamplingParams

_seq_counter = itertools.count()


def _mix64(x: int) -> int:
    """splitmix64's finalizer: spreads every input bit over the 64 (torch's CPU generator keeps only 32)."""
    x = (x + 0x9E3779B97F4A7C15) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def seed_for(seed: int, position: int, salt: int = 0) -> int:
    """The seed of one position's draw in a seeded sample; ``salt`` separates independent draws there (the
    target's sample, a draft's sample, the acceptance test)."""
    return _mix64(_mix64(_mix64(seed) ^ position) ^ salt)


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class Request:
    """One request in the core: its prompt, parameters and sequences (one per sample, forked after the prompt)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    seqs: list[Sequence] = field(default_factory=list)
    pending_grammars: list[Any] = field(default_factory=list)  # for the samples forked after the prompt
    num_cached_tokens: int | None = None  # prefix-cache hit at first scheduling
    num_prompt_logprobs: int = 0  # prompt positions scored so far (position 0 never is)
    new_prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # scored since the last output
    pooling: PoolingState | None = None  # set for a pooling request (runner "pooling")

    @property
    def finished(self) -> bool:
        """Every sample ended (an abort or error before the fork ends the samples never forked too)."""
        complete = len(self.seqs) == self.params.n or self.seqs[0].finish_reason in ("abort", "error")
        return complete and all(s.status == SeqStatus.FINISHED for s in self.seqs)

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and self.num_prompt_logprobs < len(self.prompt_token_ids) - 1

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether the next prompt chunk must return the hidden states of all its positions (prompt logprobs,
        or pooling that reads more than the last position)."""
        return self.wants_prompt_logprobs or (self.pooling is not None and self.pooling.wants_chunk_rows)

    @property
    def bypasses_prefix_cache(self) -> bool:
        """Whether every prompt position must be computed here: the cache holds keys and values, but prompt
        logprobs and MEAN/CLS pooling read the hidden states of positions it would skip."""
        return self.params.prompt_logprobs is not None or (self.pooling is not None
                                                            and self.pooling.reads_early_positions)


class OutputTokens(Seq):
    """A read-only view of a sequence's output tokens (and optional draft tokens after them), without copying."""

    def __init__(self, token_ids: list[int], start: int, extra: Seq[int] = ()) -> None:
        self._ids, self._start, self._extra = token_ids, start, extra

    def __len__(self) -> int:
        return len(self._ids) - self._start + len(self._extra)

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        base = len(self._ids) - self._start
        return self._ids[self._start + i] if i < base else self._extra[i - base]


class Sequence:
    """A token stream whose keys and values live in the pool blocks of ``block_table``."""

    def __init__(self, request: Request, index: int, token_ids: list[int], seed: int | None,
                 grammar: Any = None) -> None:
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.table_reset = True  # the runner must take the whole table (new, resumed, forked, copied)
        self.num_sent_blocks = 0  # table entries the runner already has
        self.block_chain: list[tuple[bytes, int]] = []  # (digest, serial) of each hashed full block
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab]: the draft's q, if sampled
        self.num_draft_computed = 0  # positions a draft model holds keys and values for
        self.num_drafts_verified = 0  # this sample's draft tokens verified so far, and accepted
        self.num_drafts_accepted = 0
        self.status = SeqStatus.WAITING
        self.seed = seed
        self.grammar = grammar
        self.num_sent_tokens = self.num_prompt_tokens  # output tokens already reported to the front end
        self.new_logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.finish_reported = False  # the front end has been told how it ended
        self.error: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.request.request_id}#{self.index}, {len(self)} tokens, {self.status.name})"

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def prompt_rows(self, start: int, count: int) -> int:
        """How many of the positions ``start .. start + count - 1`` hold prompt tokens."""
        return max(0, min(count, self.num_prompt_tokens - start))

    def output_view(self, drafts: Seq[int] = ()) -> OutputTokens:
        """The output tokens (followed by ``drafts``) as a view: no per-step copy of the whole output."""
        return OutputTokens(self.token_ids, self.num_prompt_tokens, drafts)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival (FCFS), then older sequence."""
        return (self.request.priority, self.request.arrival_time, self.seq_id)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens to compute before the next sample: the uncomputed ones plus the drafts to verify."""
        return len(self.token_ids) - self.num_computed_tokens + len(self.spec_token_ids)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def fork(self, index: int, seed: int | None, grammar: Any = None) -> Sequence:
        """A sibling with the same tokens so far; the block manager shares its blocks separately."""
        child = Sequence(self.request, index, self.token_ids, seed, grammar)
        child.num_computed_tokens = self.num_computed_tokens
        child.num_draft_computed = self.num_draft_computed
        child.block_chain = list(self.block_chain)
        child.status = self.status
        return child

    def clear_drafts(self) -> None:
        """Forget the drafts (verified, or not to be verified)."""
        self.spec_token_ids, self.spec_probs = [], None

    def generator_for(self, position: int, device: torch.device, salt: int = 0) -> torch.Generator | None:
        """The random stream of the token sampled at ``position`` (None when unseeded: the global one)."""
        if self.seed is None:
            return None
        return torch.Generator(device=device).manual_seed(seed_for(self.seed, position, salt))

    def take_new_tokens(self) -> list[int]:
        """Output tokens appended since the last call (what the next output carries)."""
        new = self.token_ids[self.num_sent_tokens:]
        self.num_sent_tokens = len(self.token_ids)
        return new
