"""Rejection sampling of drafts sampled from a draft distribution q against the target's p (Leviathan et al.).

Draft ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``; at the first rejection the token is
drawn from ``norm(max(0, p_j - q_j))`` instead and the rest are dropped; when every draft is accepted a bonus
token is drawn from ``p_k``. Every emitted token is then distributed exactly as p at its position.

Drafts without q (n-gram's, a greedy request's, ``rejection_sample_method: strict``) take the other test the
engine core runs: accept while the target's own sample equals the draft. For a one-hot q the two are the same
distribution; for a sampled draft this test accepts more often (``sum min(p, q)`` versus ``sum p q``).

``p`` and ``q`` are the distributions after each request's temperature, top-k/top-p/min-p, penalties and
biases (``Sampler.distribution``), so all of those hold under speculation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

ACCEPT_SALT = 1  # a seeded request's acceptance draws: independent of its samples at the same position


def rejection_sample(p: torch.Tensor, q: torch.Tensor, draft_ids: list[int],
                     generator_for: Callable[[int, int], torch.Generator | None]) -> list[int]:
    """The tokens emitted for one sequence: the accepted drafts, then one token from the residual or bonus.

    ``p``: [k+1, vocab] target probabilities (row j scores draft j; row k the bonus position); ``q``: [k, vocab]
    draft probabilities; ``generator_for(j, salt)`` the random stream of draw j (None: the global one).
    """
    k = len(draft_ids)
    ids = torch.tensor(draft_ids, dtype=torch.long, device=p.device)
    rows = torch.arange(k, device=p.device)
    uniforms = torch.stack([torch.rand((), device=p.device, generator=generator_for(j, ACCEPT_SALT))
                            for j in range(k)]) if k else p.new_zeros(0)
    accepted = uniforms * q[rows, ids] < p[rows, ids]  # u < p/q, without dividing by a zero q
    rejected = (~accepted).nonzero()
    num_accepted = int(rejected[0]) if rejected.numel() else k
    if num_accepted < k:
        dist = (p[num_accepted] - q[num_accepted]).clamp_min_(0)
        if not bool(dist.sum() > 0):  # p == q here: the residual is empty, and p itself is exact
            dist = p[num_accepted]
    else:
        dist = p[k]
    token = int(torch.multinomial(dist, 1, generator=generator_for(num_accepted, 0)))
    return draft_ids[:num_accepted] + [token]
