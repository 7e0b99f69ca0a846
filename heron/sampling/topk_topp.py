"""Temperature, min-p, top-k and top-p on a batch of logits, and Gumbel-max sampling with per-row generators.

Top-k and top-p avoid a full vocabulary sort where they can: the best ``K`` candidates (``topk``) settle every
row whose kept set fits in them; the other rows try ever more candidates, up to a full sort. Kept sets become
a per-row logit threshold, so ties at the boundary are kept (as vLLM's top-k does).
"""

from __future__ import annotations

import torch

from heron.kernels import kernels_for

_MIN_CANDIDATES = 64
_GROWTH = 8  # candidates grow 64 -> 512 -> 4096 -> ... -> a full sort, for the rows not settled yet


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Mask tokens whose probability is below ``min_p`` times the row's top probability (in logit space)."""
    threshold = logits.amax(dim=-1, keepdim=True) + min_p.log().unsqueeze(1)
    logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> None:
    """Keep each row's ``top_k`` best tokens (``vocab`` = off), then the smallest set with mass >= ``top_p``."""
    num_rows, vocab = logits.shape
    k = top_k if top_k is not None else torch.full((num_rows,), vocab, device=logits.device)
    p = top_p if top_p is not None else torch.ones(num_rows, device=logits.device)
    threshold = logits.new_full((num_rows, 1), float("-inf"))
    pending = ((k < vocab) | (p < 1)).nonzero().flatten()
    finite_k = k[k < vocab]
    num_cand = min(vocab, max(_MIN_CANDIDATES, int(finite_k.max()) if finite_k.numel() else 0))
    while pending.numel():
        sub = logits[pending]
        vals = sub.topk(num_cand, dim=-1).values if num_cand < vocab else sub.sort(dim=-1, descending=True).values
        keep, done = _keep_counts(vals, sub, k[pending], p[pending])
        threshold[pending[done]] = vals[done].gather(1, (keep[done] - 1).clamp(min=0).unsqueeze(1))
        pending = pending[~done]
        num_cand = min(vocab, num_cand * _GROWTH)
    logits.masked_fill_(logits < threshold, float("-inf"))


def _keep_counts(vals: torch.Tensor, logits: torch.Tensor, k: torch.Tensor,
                 p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How many of the descending ``vals`` each row keeps, and whether the count is final (fits in ``vals``)."""
    num_cand = vals.shape[1]
    positions = torch.arange(num_cand, device=vals.device)
    keep = k.clamp(max=num_cand)
    resolved = k <= num_cand
    if bool((p < 1).any()):
        cand = vals.masked_fill(positions >= k.unsqueeze(1), float("-inf"))
        # top-p renormalizes over the top-k set; a row without top-k normalizes over the whole vocabulary
        norm = cand.logsumexp(dim=-1)
        whole = ~resolved
        if bool(whole.any()):
            norm[whole] = logits[whole].logsumexp(dim=-1)
        probs = (cand - norm.unsqueeze(1)).exp()
        mass_before = probs.cumsum(dim=-1) - probs
        nucleus = (mass_before < p.unsqueeze(1)).sum(dim=-1)
        top_p_on = p < 1
        keep = torch.where(top_p_on, torch.minimum(keep, nucleus), keep)
        resolved = resolved | (top_p_on & (nucleus < num_cand))
    return keep, resolved


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties, a NaN above every number): heron's CPU kernel for float32 rows
    (Zen 4, 49,152 logits: 32 rows 0.14 ms against torch's 0.41, one row 11 against 28-38 us), else
    ``max(dim)``, which returns the same index."""
    kernels = kernels_for(logits)
    if kernels is not None and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1:
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def random_sample(logits: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Sample one token per row from ``softmax(logits)`` by Gumbel-max; rows in ``generators`` use their own."""
    noise = torch.empty_like(logits)
    if len(generators) < logits.shape[0]:
        noise.uniform_()
    for i, generator in generators.items():
        noise[i].uniform_(generator=generator)
    # u in [0, 1) -> Gumbel noise -log(-log u) in [-inf, ~16.6]: never +inf, so masked tokens stay -inf
    gumbel = noise.log_().neg_().log_().neg_()
    return greedy(logits + gumbel)
