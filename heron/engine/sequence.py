"""Per-request and per-sequence state. A request with ``n > 1`` owns n sequences that share its prompt blocks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any

import torch

from heron.engine.outputs import RequestMetrics
from heron.sampling.sampler import TokenLogprobs
from heron.sampling_params import SamplingParams

_seq_counter = itertools.count()


class SeqStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass
class DetokenizerState:
    """Incremental detokenization offsets (as in TGI/vLLM) and the text produced so far."""

    tokens: list[int]  # a few prompt tokens for context, then the output
    prefix_offset: int
    read_offset: int
    text: str = ""


@dataclass
class Request:
    """One user request: its prompt, parameters and the sequences sampling its ``n`` completions."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    pending_grammars: list[Any] = field(default_factory=list)  # for the samples forked after the prompt

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(s.status == SeqStatus.FINISHED for s in self.seqs)


class Sequence:
    """A token stream whose keys and values live in the blocks of ``block_table``."""

    def __init__(self, request: Request, index: int, token_ids: list[int], generator: torch.Generator | None,
                 grammar: Any = None) -> None:
        self.seq_id = next(_seq_counter)
        self.request = request
        self.index = index
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.status = SeqStatus.WAITING
        self.generator = generator
        self.grammar = grammar
        self.logprobs: list[TokenLogprobs] = []
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.detok: DetokenizerState | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"Sequence({self.request.request_id}#{self.index}, {len(self)} tokens, {self.status.name})"

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then earlier arrival (FCFS)."""
        return (self.request.priority, self.request.metrics.arrival_time, self.seq_id)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def fork(self, index: int, generator: torch.Generator | None, grammar: Any = None) -> Sequence:
        """A sibling with the same tokens so far; the block manager shares its blocks separately."""
        child = Sequence(self.request, index, self.token_ids, generator, grammar)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        return child
