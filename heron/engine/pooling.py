"""A pooling request's vector in the making, folded from the final hidden states of its prompt chunks.

The scheduler runs a pooling request as a prompt-only request (chunked prefill, the same token budget); the
runner returns the hidden states of the rows the request wants, and ``PoolingState.add`` folds them in chunk by
chunk. A preempted prompt is computed again from its start, so positions already folded in are skipped: MEAN
counts each position once however often it was computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from heron.pooling_params import PoolerConfig, PoolingParams


@dataclass
class PoolingState:
    """The state of one request's pooling: what it reads, how far it got, and its result."""

    pooling_type: str  # LAST | MEAN | CLS
    normalize: bool
    num_prompt_tokens: int
    num_pooled: int = 0  # prompt positions folded in so far
    acc: torch.Tensor | None = None  # float32: the sum (MEAN), the first row (CLS) or the last row (LAST)
    output: bytes | None = None  # the vector as little-endian float32, once the whole prompt is folded in

    @classmethod
    def of(cls, params: PoolingParams, config: PoolerConfig, num_prompt_tokens: int) -> PoolingState:
        normalize = config.normalize if params.normalize is None else params.normalize
        return cls(config.pooling_type, normalize, num_prompt_tokens)

    @property
    def reads_early_positions(self) -> bool:
        """Whether a position before the prompt's last is read, so none may come from the prefix cache (which
        keeps keys and values, not hidden states)."""
        return self.pooling_type != "LAST"

    @property
    def wants_chunk_rows(self) -> bool:
        """Whether the next chunk must return every row, not only its last: MEAN reads them all, and CLS
        reads position 0, which the runner returns only with the rest of its chunk."""
        return self.pooling_type == "MEAN" or (self.pooling_type == "CLS" and self.num_pooled == 0)

    def add(self, rows: torch.Tensor, end: int) -> None:
        """Fold in ``rows``: the final hidden states of the positions just before ``end``."""
        start = end - len(rows)
        if self.pooling_type == "MEAN":
            fresh = rows[max(self.num_pooled - start, 0):].float().sum(0)
            self.acc = fresh if self.acc is None else self.acc + fresh
        elif self.pooling_type == "CLS" and start == 0 and self.num_pooled == 0:
            self.acc = rows[0].float().clone()  # a copy: the step's hidden states are not kept alive
        elif self.pooling_type == "LAST" and end == self.num_prompt_tokens:
            self.acc = rows[-1].float()
        self.num_pooled = max(self.num_pooled, end)
        if self.num_pooled == self.num_prompt_tokens:
            self.output, self.acc = self._finish(), None

    def _finish(self) -> bytes:
        vector = self.acc / self.num_prompt_tokens if self.pooling_type == "MEAN" else self.acc
        if self.normalize:
            vector = torch.nn.functional.normalize(vector, dim=-1)
        return vector.cpu().numpy().astype("<f4").tobytes()
