"""Top-k / top-p / min-p masks against a direct per-row reference, and Gumbel-max sampling statistics."""

from __future__ import annotations

import pytest
import torch

from heron.sampling.topk_topp import apply_min_p, apply_top_k_top_p, random_sample

# chi-square critical values at alpha = 0.001 (scipy.stats.chi2.ppf(0.999, df))
CHI2_CRIT_999 = {9: 27.877, 19: 43.820}


def reference_kept(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """The kept token ids of one row: the k best (k < 0: all), then the smallest prefix of mass >= p (p = 1:
    all of them, as vLLM's top_p = 1 is off; a float64 cumsum can reach 1 before a peaked row's tail)."""
    order = logits.argsort(descending=True)
    if k > 0:
        order = order[:k]
    if p >= 1:
        return set(order.tolist())
    probs = torch.softmax(logits[order].double(), dim=0)
    mass_before = probs.cumsum(0) - probs
    return set(order[: int((mass_before < p).sum())].tolist())


def kept(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


@pytest.mark.parametrize("scale", [0.05, 1.0, 8.0], ids=["flat", "normal", "peaked"])
def test_top_k_top_p_matches_reference(scale):
    g = torch.Generator().manual_seed(0)
    rows, vocab = 24, 3000
    logits = torch.randn(rows, vocab, generator=g) * scale
    ks = [-1, 1, 5, 40, 64, 200, -1, -1] * 3
    ps = [0.9, 1.0, 0.5, 0.95, 1.0, 0.3, 0.999, 1.0] * 3
    top_k = torch.tensor([vocab if k < 0 else k for k in ks])
    out = logits.clone()
    apply_top_k_top_p(out, top_k, torch.tensor(ps))
    for i, got in enumerate(kept(out)):
        assert got == reference_kept(logits[i], ks[i], ps[i]), f"row {i}: k={ks[i]} p={ps[i]}"
    finite = torch.isfinite(out)
    assert torch.equal(out[finite], logits[finite])  # kept logits are untouched


def test_top_k_only_and_top_p_only():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 500, generator=g)
    out = logits.clone()
    apply_top_k_top_p(out, torch.tensor([3, 500, 77]), None)
    assert [len(s) for s in kept(out)] == [3, 500, 77]
    out = logits.clone()
    apply_top_k_top_p(out, None, torch.tensor([0.2, 1.0, 0.7]))
    assert kept(out) == [reference_kept(logits[i], -1, p) for i, p in enumerate([0.2, 1.0, 0.7])]


def test_min_p_keeps_tokens_above_fraction_of_max():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 200, generator=g) * 2
    min_p = torch.tensor([0.0, 0.05, 0.3, 1.0])
    out = logits.clone()
    apply_min_p(out, min_p)
    probs = torch.softmax(logits, dim=-1)
    for i in range(4):
        expected = probs[i] >= min_p[i] * probs[i].max() * (1 - 1e-5)
        assert torch.equal(torch.isfinite(out[i]), expected)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_gumbel_sampling_matches_softmax(temperature):
    torch.manual_seed(0)
    base = torch.randn(10, generator=torch.Generator().manual_seed(3))
    num = 40000
    tokens = random_sample(base.repeat(num, 1) / temperature, {})
    counts = torch.bincount(tokens, minlength=10).double()
    assert chi_square(counts, torch.softmax(base.double() / temperature, 0)) < CHI2_CRIT_999[9]
    # the test has power: the same counts are rejected under a different temperature
    assert chi_square(counts, torch.softmax(base.double() / (temperature * 1.5), 0)) > CHI2_CRIT_999[9]


def test_random_sample_never_picks_masked_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2000, 50)
    logits[:, ::2] = float("-inf")
    tokens = random_sample(logits, {})
    assert (tokens % 2 == 1).all()


def test_generator_rows_are_independent_of_the_batch():
    logits = torch.zeros(5, 1000)
    alone = random_sample(logits[:1].clone(), {0: torch.Generator().manual_seed(42)})
    torch.manual_seed(123)
    mixed = random_sample(logits.clone(), {3: torch.Generator().manual_seed(42), 1: torch.Generator().manual_seed(7)})
    assert mixed[3] == alone[0]
    other = random_sample(logits[:1].clone(), {0: torch.Generator().manual_seed(43)})
    assert other[0] != alone[0]
