"""Repetition, frequency and presence penalties with vLLM's formulas, on the whole batch at once.

- repetition (prompt and output tokens): a positive logit is divided by the penalty, a non-positive one
  multiplied by it;
- frequency (output tokens): ``logit -= frequency_penalty * count``;
- presence (output tokens): ``logit -= presence_penalty * (count > 0)``.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from heron.sampling.sampler import SamplingRow
    from heron.sampling_params import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    """Whether ``params`` asks for any penalty."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Apply every row's penalties in place; rows without penalties are left unchanged."""
    params = [r.params for r in rows]
    if not any(has_penalties(p) for p in params):
        return
    device = logits.device
    counts = _token_counts(logits, [r.output_token_ids if has_penalties(r.params) else [] for r in rows])
    output_seen = counts > 0
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        seen = _token_counts(logits, [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else []
                                      for r in rows]) > 0
        seen |= output_seen
        rep = torch.tensor(repetition, dtype=logits.dtype, device=device).unsqueeze(1)
        scale = torch.where(seen, rep, torch.ones_like(rep))
        logits.copy_(torch.where(logits > 0, logits / scale, logits * scale))
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)
    logits.sub_(counts * frequency.unsqueeze(1) + output_seen * presence.unsqueeze(1))


def _token_counts(logits: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """``[rows, vocab]`` counts of each row's tokens, in the logits' dtype."""
    counts = torch.zeros_like(logits)
    lengths = torch.tensor([len(t) for t in token_lists], device=logits.device)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=logits.device)
    if tokens.numel():
        row_ids = torch.arange(len(token_lists), device=logits.device).repeat_interleave(lengths)
        counts.index_put_((row_ids, tokens), torch.ones_like(tokens, dtype=logits.dtype), accumulate=True)
    return counts
