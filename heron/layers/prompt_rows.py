"""Which rows of a step's flat batch are prompt tokens, for layers that compute those another way.

Prompt tokens arrive many per sequence (matrix-matrix work); generated ones one or a few (decodes, speculative
verification: matrix-vector work), and the fastest kernel differs: an integer-weight linear layer may send
prompt rows to a dense bfloat16 copy of its weight (heron/quantization/packed_int.py). A row's role does not
depend on what else its step holds, how its prompt was chunked or how much of it the prefix cache held, so
neither does the kernel it takes. The model's forward publishes the step's rows here (``step_rows``) around
its layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepRows:
    """The indices of a step's prompt rows and of its other rows (None: no such rows)."""

    prompt: torch.Tensor | None
    other: torch.Tensor | None

    @classmethod
    def of(cls, query_lens: list[int], prompt_rows: list[int]) -> StepRows:
        """The rows of a step whose sequence i has ``query_lens[i]`` rows, the first ``prompt_rows[i]`` of them
        prompt tokens."""
        prompt, other, start = [], [], 0
        for n, p in zip(query_lens, prompt_rows, strict=True):
            prompt.extend(range(start, start + p))
            other.extend(range(start + p, start + n))
            start += n
        as_index = lambda rows: torch.tensor(rows, dtype=torch.long) if rows else None  # noqa: E731
        return cls(as_index(prompt), as_index(other))


_NO_PROMPT = StepRows(None, None)
_current: ContextVar[StepRows] = ContextVar("heron_step_rows", default=_NO_PROMPT)


@contextmanager
def step_rows(query_lens: list[int], prompt_rows: list[int]) -> Iterator[None]:
    """Within the block, ``current_rows()`` gives the rows of the step (see ``StepRows.of``)."""
    token = _current.set(StepRows.of(query_lens, prompt_rows) if any(prompt_rows) else _NO_PROMPT)
    try:
        yield
    finally:
        _current.reset(token)


@contextmanager
def kept_rows(keep: torch.Tensor | None, total: int) -> Iterator[None]:
    """Within the block, ``current_rows()`` gives the step's rows among ``keep`` (ascending indices of its
    ``total`` rows), renumbered: the layers after a model dropped the rows whose outputs nobody wants. None: all
    rows, as they are."""
    rows = _current.get()
    if keep is None or rows.prompt is None:
        yield
        return
    is_prompt = torch.zeros(total, dtype=torch.bool)
    is_prompt[rows.prompt] = True
    kept = is_prompt[keep.cpu()]
    as_index = lambda mask: mask.nonzero().flatten() if mask.any() else None  # noqa: E731
    token = _current.set(StepRows(as_index(kept), as_index(~kept)))
    try:
        yield
    finally:
        _current.reset(token)


def current_rows() -> StepRows:
    """The rows of the step being computed (no prompt rows outside ``step_rows``)."""
    return _current.get()
