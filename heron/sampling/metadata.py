"""Per-row sampling parameters of one batch, gathered once per sampler call into tensors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from heron.sampling.sampler import SamplingRow


@dataclass
class SamplingMetadata:
    """What the sampling step needs per row; a tensor is None when no row of the batch uses that option."""

    greedy: torch.Tensor  # [rows] bool
    any_greedy: bool
    all_greedy: bool
    temperature: torch.Tensor | None  # [rows]; greedy rows hold 1.0
    min_p: torch.Tensor | None
    top_k: torch.Tensor | None  # [rows] long; vocab size where off
    top_p: torch.Tensor | None  # [rows]; 1.0 where off
    generators: dict[int, torch.Generator]

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> SamplingMetadata:
        """Collect the rows' parameters; options of greedy rows are neutralized (they take the argmax)."""
        params = [r.params for r in rows]
        greedy = [p.greedy for p in params]
        sampled = [p for p in params if not p.greedy]
        temps = [1.0 if p.greedy else p.temperature for p in params]
        min_ps = [0.0 if p.greedy else p.min_p for p in params]
        top_ks = [vocab_size if p.greedy or p.top_k < 0 else min(p.top_k, vocab_size) for p in params]
        top_ps = [1.0 if p.greedy else p.top_p for p in params]

        def tensor(values: list, used: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
            return torch.tensor(values, dtype=dtype, device=device) if used else None

        return cls(
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            any_greedy=any(greedy),
            all_greedy=not sampled,
            temperature=tensor(temps, bool(sampled)),
            min_p=tensor(min_ps, any(p.min_p > 0 for p in sampled)),
            top_k=tensor(top_ks, any(k < vocab_size for k in top_ks), torch.long),
            top_p=tensor(top_ps, any(p.top_p < 1 for p in sampled)),
            generators={i: r.generator for i, r in enumerate(rows) if r.generator is not None and not greedy[i]},
        )
