"""Batched sampler: one call per engine step turns a [rows, vocab] logits tensor into one token per row."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about the sequence behind one row of logits."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    grammar: object | None = None


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
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    ranks = (logprobs > chosen.unsqueeze(1)).sum(dim=1) + 1
    top_vals, top_ids = (logprobs.topk(num_top, dim=-1) if num_top > 0
                         else (logprobs[:, :0], token_ids.view(-1, 1)[:, :0]))
    out = []
    for i in range(logits.shape[0]):
        top = list(zip(top_ids[i].tolist(), top_vals[i].tolist()))
        out.append(TokenLogprobs(int(token_ids[i]), float(chosen[i]), int(ranks[i]), top))
    return out


class Sampler:
    """Samples one token per row; greedy rows take the argmax, others sample from softmax(logits / T)."""

    def __init__(self, vocab_size: int, eos_token_ids=()) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = set(eos_token_ids)

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        logits = logits.float()
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in rows],
                             device=logits.device)
        greedy = logits.argmax(dim=-1)
        probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
        tokens = greedy.clone()
        for i, row in enumerate(rows):
            if not row.params.greedy:
                tokens[i] = torch.multinomial(probs[i], 1, generator=row.generator)
        want = [r.params.logprobs for r in rows]
        lps: list[TokenLogprobs | None] = [None] * len(rows)
        if any(w is not None for w in want):
            k = max(w or 0 for w in want)
            for i, lp in enumerate(gather_logprobs(logits, tokens, k)):
                if want[i] is not None:
                    lp.top = lp.top[: want[i]]
                    lps[i] = lp
        return SamplerOutput(tokens.tolist(), lps)
