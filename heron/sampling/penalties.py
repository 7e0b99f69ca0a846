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
    """Apply every row's penalties in place; rows without penalties are left unchanged.

    Only the entries of tokens a row has seen change, so the work is proportional to the number of prompt and
    output tokens, not to the vocabulary.
    """
    params = [r.params for r in rows]
    penalized = [has_penalties(p) for p in params]
    if not any(penalized):
        return
    flat = logits.view(-1)
    vocab = logits.shape[1]
    output_idx, output_counts = _flat_token_ids(logits, [r.output_token_ids if pen else []
                                                         for r, pen in zip(rows, penalized, strict=True)])
    repetition = [p.repetition_penalty for p in params]
    if any(r != 1.0 for r in repetition):
        prompt_idx, _ = _flat_token_ids(logits, [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else []
                                                 for r in rows])
        seen = torch.cat([prompt_idx, output_idx]).unique()
        rep = torch.tensor(repetition, dtype=logits.dtype, device=logits.device)[seen // vocab]
        x = flat[seen]
        flat[seen] = torch.where(x > 0, x / rep, x * rep)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=logits.device)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=logits.device)
    row_of = output_idx // vocab
    flat[output_idx] -= frequency[row_of] * output_counts + presence[row_of]


def _flat_token_ids(logits: torch.Tensor, token_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct ``row * vocab + token`` indices of each row's tokens, and how often each occurs."""
    device = logits.device
    lengths = torch.tensor([len(t) for t in token_lists], device=device)
    tokens = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long, device=device)
    row_ids = torch.arange(len(token_lists), device=device).repeat_interleave(lengths)
    idx, counts = (row_ids * logits.shape[1] + tokens).unique(return_counts=True)
    return idx, counts.to(logits.dtype)
