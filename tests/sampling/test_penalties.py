"""Repetition / frequency / presence penalties against a direct per-token computation of vLLM's formulas."""

from __future__ import annotations

import torch

from heron.sampling.penalties import apply_penalties
from heron.sampling.sampler import Sampler, SamplingRow
from heron.sampling_params import SamplingParams


def reference(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    out = logits.clone()
    for i, r in enumerate(rows):
        p = r.params
        for t in range(logits.shape[1]):
            x = float(out[i, t])
            count = r.output_token_ids.count(t)
            if t in r.prompt_token_ids or count:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            out[i, t] = x
    return out


def make_rows() -> list[SamplingRow]:
    cases = [
        dict(repetition_penalty=1.3),
        dict(frequency_penalty=0.7),
        dict(presence_penalty=-0.4),
        dict(repetition_penalty=0.8, frequency_penalty=-1.1, presence_penalty=1.5),
        dict(),  # no penalties: untouched
    ]
    prompts = [[1, 2, 3, 3], [4, 5], [6], [7, 8, 9, 1], [1, 2, 3]]
    outputs = [[3, 10, 10], [5, 11, 11, 11, 2], [12, 12], [9, 13, 13, 2], [1, 1]]
    return [SamplingRow(SamplingParams(**c), pr, out, None)
            for c, pr, out in zip(cases, prompts, outputs, strict=True)]


def test_penalties_match_the_reference_formulas():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(0)) * 3
    assert (logits > 0).any() and (logits < 0).any()
    rows = make_rows()
    got = logits.clone()
    apply_penalties(got, rows)
    torch.testing.assert_close(got, reference(logits, rows), rtol=0, atol=1e-6)
    assert torch.equal(got[4], logits[4])
    assert not torch.equal(got[3], logits[3])


def test_greedy_with_penalties_picks_the_argmax_of_penalized_logits():
    logits = torch.randn(5, 20, generator=torch.Generator().manual_seed(1)) * 3
    rows = make_rows()
    for r in rows:
        r.params.temperature = 0
    expected = reference(logits, rows).argmax(-1).tolist()
    assert Sampler(20)(logits, rows).token_ids == expected


def test_repetition_penalty_discourages_repeats():
    logits = torch.zeros(1, 10)
    logits[0, 4] = 1.0
    logits[0, 5] = 0.9
    row = SamplingRow(SamplingParams(temperature=0, repetition_penalty=1.2), [4], [], None)
    assert Sampler(10)(logits, [row]).token_ids == [5]
