"""Rejection sampling on synthetic distributions: every emitted position is distributed as p."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from heron.spec_decode.rejection_sampler import rejection_sample


def test_emitted_tokens_follow_p_at_every_position():
    g = torch.Generator().manual_seed(0)
    vocab, k, trials = 6, 3, 20000
    p = torch.softmax(torch.randn(k + 1, vocab, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(k, vocab, generator=g) * 1.5, -1)
    torch.manual_seed(0)
    by_position = [Counter() for _ in range(k + 1)]
    lengths = Counter()
    for _ in range(trials):
        drafts = [int(torch.multinomial(q[j], 1)) for j in range(k)]
        out = rejection_sample(p, q, drafts, lambda j, salt: None)
        assert out[:-1] == drafts[:len(out) - 1]  # the accepted drafts, then one token of the model's
        lengths[len(out)] += 1
        for j, t in enumerate(out):
            by_position[j][t] += 1
    assert all(lengths[n] > 0 for n in range(1, k + 2))  # rejections at every position, and full acceptance
    for j in range(k + 1):  # p's rows do not depend on the prefix here, so each position's token ~ p[j]
        n = sum(by_position[j].values())
        freq = torch.tensor([by_position[j][t] / n for t in range(vocab)])
        assert torch.allclose(freq, p[j], atol=4 * (p[j] * (1 - p[j]) / n).sqrt().max().item() + 1e-3), j


def test_identical_distributions_accept_every_draft():
    p = torch.softmax(torch.randn(4, 10), -1)
    drafts = [1, 2, 3]
    assert rejection_sample(p, p[:3].clone(), drafts, lambda j, salt: None)[:3] == drafts


def test_a_draft_the_target_rules_out_is_always_rejected():
    p = torch.tensor([[0.0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])
    q = torch.tensor([[1.0, 0.0, 0.0]])
    for _ in range(50):
        out = rejection_sample(p, q, [0], lambda j, salt: None)
        assert len(out) == 1 and out[0] in (1, 2)


def test_seeded_draws_repeat():
    p = torch.softmax(torch.randn(3, 50), -1)
    q = torch.softmax(torch.randn(2, 50), -1)

    def gen(j, salt):
        return torch.Generator().manual_seed(1000 * j + salt)

    outs = {tuple(rejection_sample(p, q, [4, 5], gen)) for _ in range(5)}
    assert len(outs) == 1


@pytest.mark.parametrize("k", [0, 1])
def test_no_or_one_draft(k):
    p = torch.softmax(torch.randn(k + 1, 8), -1)
    q = torch.softmax(torch.randn(k, 8), -1)
    out = rejection_sample(p, q, [3] * k, lambda j, salt: None)
    assert 1 <= len(out) <= k + 1
