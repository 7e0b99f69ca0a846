"""The vocabulary-sized layers: the token embedding and the LM head, each split by vocabulary rows over the
tensor-parallel ranks (Megatron's vocab-parallel layers).

Rank r holds rows ``[r * rows, (r + 1) * rows)`` of a vocabulary padded up to ``rows * ranks`` (padding rows
are zero), so any vocabulary size shards. An embedding lookup zeroes the ids another rank holds and one
all-reduce sums the parts; the LM head's partial logits are gathered on rank 0, which samples.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from heron.distributed.parallel_state import all_reduce, gather_last_dim, get_tp_group
from heron.layers.linear import Linear
from heron.quantization.base import QuantizationMethod


def vocab_rows(vocab_size: int) -> int:
    """Vocabulary rows each rank holds."""
    return -(-vocab_size // get_tp_group().size)


def vocab_part(loaded, vocab_size: int):
    """This rank's rows of a checkpoint tensor (or GGUF blocks) with one row per token, zero-padded to
    ``vocab_rows``."""
    tp = get_tp_group()
    if tp.size == 1:
        return loaded
    rows = vocab_rows(vocab_size)
    start = min(tp.rank * rows, vocab_size)
    part = loaded.narrow(0, start, min(rows, vocab_size - start))
    if part.shape[0] == rows:
        return part
    return F.pad(part, (0, 0, 0, rows - part.shape[0])) if isinstance(part, torch.Tensor) else part.padded_rows(rows)


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are split over the ranks (whole with one rank)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.rows = vocab_rows(vocab_size)
        self.start = get_tp_group().rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        part = vocab_part(loaded, self.vocab_size)
        if part.shape != param.shape:
            raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
        param.data.copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.rows == self.vocab_size:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """The output projection, its vocabulary rows split over the ranks; rank 0 gets the whole logits."""

    step_rows = False
    float_output = True

    def __init__(self, hidden_size: int, vocab_size: int, quant_method: QuantizationMethod | None = None) -> None:
        super().__init__(hidden_size, vocab_rows(vocab_size), quant_method=quant_method)
        self.vocab_size = vocab_size

    def shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None) -> torch.Tensor:
        return vocab_part(loaded, self.vocab_size) if getattr(param, "output_dim", None) == 0 else loaded

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if self.output_size == self.vocab_size:
            return logits
        return gather_last_dim(logits)[..., :self.vocab_size]
