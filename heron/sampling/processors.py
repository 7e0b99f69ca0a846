"""Logit masks and biases that requests ask for: allowed_token_ids, bad_words, min_tokens, logit_bias.

Each function gathers the (row, token) pairs of the whole batch in Python (the rows' own small lists, never
vocabulary-sized data) and changes the logits with one indexed tensor operation; allowed_token_ids masks are
built once per request (per list object) and cached.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from heron.sampling.sampler import SamplingRow

_NEG_INF = float("-inf")
_MASK_CACHE_SIZE = 256
# allowed_token_ids masks, keyed by the list object (held here, so its id stays unique while cached); a request's
# list is not changed while it runs
_masks: OrderedDict[tuple, tuple[list[int], torch.Tensor]] = OrderedDict()


def changes_logits(row: SamplingRow) -> bool:
    """Whether any function of this module would change ``row``'s logits this step."""
    p = row.params
    return bool(p.allowed_token_ids is not None or p.bad_words_token_ids or p.logit_bias
                or len(row.output_token_ids) < p.min_tokens)


def apply_allowed_token_ids(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Rows with ``allowed_token_ids`` may only sample those tokens."""
    limited = [i for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if not limited:
        return
    mask = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    mask[limited] = torch.stack([_disallowed(rows[i].params.allowed_token_ids, logits) for i in limited])
    logits.masked_fill_(mask, _NEG_INF)


def apply_bad_words(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Ban a bad word's last token where the output already ends with the word's other tokens (as vLLM)."""
    pairs = []
    for i, row in enumerate(rows):
        for word in row.params.bad_words_token_ids or ():
            prefix = word[:-1]
            if _ends_with(row.output_token_ids, prefix):
                pairs.append((i, word[-1]))
    _index_put(logits, pairs, _NEG_INF)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: Iterable[int]) -> None:
    """Until a row has ``min_tokens`` outputs, ban its stop_token_ids and the eos ids (vLLM bans eos even with
    ignore_eos)."""
    eos = tuple(eos_token_ids)
    pairs = [(i, t) for i, r in enumerate(rows) if len(r.output_token_ids) < r.params.min_tokens
             for t in (*eos, *r.params.stop_token_ids)]
    _index_put(logits, pairs, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Add each row's ``logit_bias`` (token id -> bias) to its logits."""
    pairs, biases = [], []
    for i, row in enumerate(rows):
        for t, b in (row.params.logit_bias or {}).items():
            pairs.append((i, t))
            biases.append(b)
    if pairs:
        _index_put(logits, pairs, torch.tensor(biases, dtype=logits.dtype, device=logits.device), accumulate=True)


def _disallowed(allowed: list[int], logits: torch.Tensor) -> torch.Tensor:
    """The ``[vocab]`` mask of tokens outside ``allowed``, built once per list object and device."""
    key = (id(allowed), logits.shape[1], logits.device)
    hit = _masks.get(key)
    if hit is not None and hit[0] is allowed:
        _masks.move_to_end(key)
        return hit[1]
    mask = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
    mask[torch.tensor(allowed, dtype=torch.long, device=logits.device)] = False
    _masks[key] = (allowed, mask)
    if len(_masks) > _MASK_CACHE_SIZE:
        _masks.popitem(last=False)
    return mask


def _ends_with(tokens: list[int], suffix: list[int]) -> bool:
    return len(suffix) <= len(tokens) and (not suffix or tokens[-len(suffix):] == suffix)


def _index_put(target: torch.Tensor, pairs: list[tuple[int, int]], value: float | bool | torch.Tensor,
               accumulate: bool = False) -> None:
    """``target[row, token] = value`` (or ``+=``) for every pair."""
    if not pairs:
        return
    index = torch.tensor(pairs, dtype=torch.long, device=target.device)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=target.dtype, device=target.device)
    target.index_put_((index[:, 0], index[:, 1]), value, accumulate=accumulate)
