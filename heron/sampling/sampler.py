"""Batched sampler: one call per engine step turns a [rows, vocab] logits tensor into one token per row.

Order of operations (vLLM v1's): grammar masks -> raw logprobs -> allowed_token_ids, bad_words, min_tokens,
logit_bias -> repetition/frequency/presence penalties -> greedy argmax, or temperature -> min_p -> top_k/top_p
-> Gumbel-max sampling. Every step is a batched tensor operation over the whole vocabulary; Python only walks
the rows' own small lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from heron.sampling.metadata import SamplingMetadata
from heron.sampling.penalties import apply_penalties, has_penalties
from heron.sampling.processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    changes_logits,
)
from heron.sampling.topk_topp import apply_min_p, apply_top_k_top_p, greedy, random_sample
from heron.sampling_params import SamplingParams

if TYPE_CHECKING:
    from heron.sampling.structured import GrammarMasker, GrammarState


@dataclass
class SamplingRow:
    """What the sampler needs to know about the sequence behind one row of logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None


@dataclass
class TokenLogprobs:
    """The sampled (or given) token's logprob and rank, plus the top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprobs]:
    """Logprob and rank of ``token_ids[i]`` under ``log_softmax(logits[i])``, with the ``num_top`` best tokens."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.to(logprobs.device).view(-1, 1))
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_vals, top_ids = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
    rows = zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), top_ids.tolist(), top_vals.tolist(), strict=True)
    return [TokenLogprobs(t, lp, r, list(zip(ids, vals, strict=True))) for t, lp, r, ids, vals in rows]


class Sampler:
    """Samples one token per row with each row's SamplingParams (see the module docstring for the order)."""

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(set(eos_token_ids))
        self._grammar_masker: GrammarMasker | None = None

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """Sample a token for each row of ``logits`` ([len(rows), vocab]); the input tensor is not modified."""
        assert logits.shape == (len(rows), self.vocab_size), f"logits {tuple(logits.shape)} for {len(rows)} rows"
        assert all(r.params.bad_words_token_ids is not None or not r.params.bad_words for r in rows), \
            "bad_words need params.update_from_tokenizer(tokenizer) before sampling"
        want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if all(r.params.greedy and r.grammar is None and not changes_logits(r) and not has_penalties(r.params)
               for r in rows):
            tokens = greedy(logits)
            return SamplerOutput(tokens.tolist(), self._logprobs(logits[want], tokens, rows, want))
        logits, raw = self._process(logits, rows, want)
        tokens = self._sample(logits, SamplingMetadata.from_rows(rows, logits.shape[1], logits.device))
        return SamplerOutput(tokens.tolist(), self._logprobs(raw, tokens, rows, want))

    def distribution(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The float32 ``[rows, vocab]`` probabilities each row samples from: every step of ``__call__`` but the
        draw (a greedy row's is one-hot on its argmax). Speculative decoding's p and q."""
        logits = self.process(logits, rows)
        meta = SamplingMetadata.from_rows(rows, logits.shape[1], logits.device)
        greedy_tokens = greedy(logits) if meta.any_greedy else None
        if not meta.all_greedy:
            self._warp(logits, meta)
        probs = torch.softmax(logits, dim=-1)
        if greedy_tokens is not None:
            one_hot = torch.zeros_like(probs).scatter_(1, greedy_tokens.unsqueeze(1), 1.0)
            probs = torch.where(meta.greedy.unsqueeze(1), one_hot, probs)
        return probs

    def process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """A float32 copy of ``logits`` with the rows' grammar masks, token masks, biases and penalties applied."""
        return self._process(logits, rows, [])[0]

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow],
                 want: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """A float32 copy of ``logits`` with grammar masks, token masks, biases and penalties applied, and the
        rows ``want`` before them (logprobs come from the model's distribution)."""
        logits = logits.to(torch.float32, copy=True)
        if any(r.grammar is not None for r in rows):
            self._masker().apply(logits, [r.grammar for r in rows])
        raw = logits[want]
        apply_allowed_token_ids(logits, rows)
        apply_bad_words(logits, rows)
        apply_min_tokens(logits, rows, self.eos_token_ids)
        apply_logit_bias(logits, rows)
        apply_penalties(logits, rows)
        return logits, raw

    @staticmethod
    def _warp(logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """Temperature, min-p, top-k and top-p, in place (greedy rows are left neutral)."""
        logits.div_(meta.temperature.unsqueeze(1))
        if meta.min_p is not None:
            apply_min_p(logits, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            apply_top_k_top_p(logits, meta.top_k, meta.top_p)

    @classmethod
    def _sample(cls, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = greedy(logits) if meta.any_greedy else None
        if meta.all_greedy:
            return greedy_tokens
        cls._warp(logits, meta)
        sampled = random_sample(logits, meta.generators)
        return sampled if greedy_tokens is None else torch.where(meta.greedy, greedy_tokens, sampled)

    @staticmethod
    def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow],
                  want: list[int]) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if not want:
            return out
        num_top = max(rows[i].params.logprobs for i in want)
        for i, lp in zip(want, gather_logprobs(raw, tokens[want], num_top), strict=True):
            lp.top = lp.top[: rows[i].params.logprobs]
            out[i] = lp
        return out

    def _masker(self) -> GrammarMasker:
        if self._grammar_masker is None:
            from heron.sampling.structured import GrammarMasker  # xgrammar loads only when a grammar is used

            self._grammar_masker = GrammarMasker()
        return self._grammar_masker
