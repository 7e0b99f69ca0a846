"""The persistent input batch: a block-table row per running sequence, kept across steps and updated by diffs.

Each step turns a ``SchedulerOutput`` into the flat model inputs (token ids, positions, slot mapping) and the
attention metadata with vectorised operations over the step's sequences and new tokens: nothing here walks
a sequence's whole context.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from heron.attention.backend import AttentionMetadata
from heron.engine.scheduler import SchedulerOutput


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    meta: AttentionMetadata
    logits_index: torch.Tensor  # [sum(num_logits)] long: flat token indices whose logits are wanted


class InputBatch:
    """Block-table rows of the running sequences (int32, updated by each step's diffs)."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, block_size: int, device: torch.device,
                 max_num_tokens: int) -> None:
        self.block_size = block_size
        self.device = device
        self.block_table = torch.zeros((max_rows, max_blocks_per_seq), dtype=torch.int32)
        # per-token host buffers, allocated once: a step fills a prefix of each
        self._ids = np.zeros(max_num_tokens, dtype=np.int64)
        self._positions = np.zeros(max_num_tokens, dtype=np.int64)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.row_of: dict[int, int] = {}
        self.free_rows = list(range(max_rows - 1, -1, -1))

    def update(self, sched: SchedulerOutput) -> None:
        """Release the rows of freed sequences, then apply each scheduled sequence's block-table diff."""
        for seq_id in sched.freed_seq_ids:
            row = self.row_of.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)
        for s in sched.seqs:
            row = self.row_of.get(s.seq_id)
            if row is None:
                row = self.row_of[s.seq_id] = self._take_row()
            first = 0 if s.reset else int(self.num_blocks[row])
            if s.block_ids:
                self.block_table[row, first:first + len(s.block_ids)] = torch.tensor(s.block_ids, dtype=torch.int32)
            self.num_blocks[row] = first + len(s.block_ids)

    def _take_row(self) -> int:
        if not self.free_rows:  # more sequences than planned for: grow rather than fail
            grown = self.block_table.shape[0]
            self.block_table = torch.cat([self.block_table, torch.zeros_like(self.block_table)])
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
            self.free_rows = list(range(2 * grown - 1, grown - 1, -1))
        return self.free_rows.pop()

    def prepare(self, sched: SchedulerOutput) -> ModelInputs:
        """Flat inputs of the scheduled sequences, in their order."""
        bs = self.block_size
        rows = np.fromiter((self.row_of[s.seq_id] for s in sched.seqs), dtype=np.int64, count=len(sched.seqs))
        query_lens = np.fromiter((len(s.token_ids) for s in sched.seqs), dtype=np.int64, count=len(rows))
        starts = np.fromiter((s.start_pos for s in sched.seqs), dtype=np.int64, count=len(rows))
        num_logits = np.fromiter((s.num_logits for s in sched.seqs), dtype=np.int64, count=len(rows))
        cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=cu[1:])
        total = int(cu[-1])
        if total > len(self._ids):  # a step larger than the token budget (a profiling probe): grow once
            self._ids, self._positions = np.zeros(total, dtype=np.int64), np.zeros(total, dtype=np.int64)
        seq_of_token = np.repeat(np.arange(len(rows)), query_lens)
        positions = self._positions[:total]
        np.add(starts[seq_of_token], np.arange(total) - cu[:-1][seq_of_token], out=positions)
        context_lens = starts + query_lens
        max_blocks = int(-(-context_lens.max() // bs))
        step_table = self.block_table[torch.from_numpy(rows), :max_blocks]
        pos = torch.from_numpy(positions)
        tok_seq = torch.from_numpy(seq_of_token)
        slots = step_table[tok_seq, pos // bs].long() * bs + pos % bs
        input_ids = self._ids[:total]
        input_ids[:] = [t for s in sched.seqs for t in s.token_ids]
        ends = cu[1:]
        logit_seq = np.repeat(np.arange(len(rows)), num_logits)
        logit_cu = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(num_logits, out=logit_cu[1:])
        logits_index = ends[logit_seq] - num_logits[logit_seq] + (np.arange(int(logit_cu[-1])) - logit_cu[:-1][logit_seq])
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.from_numpy(cu).to(dev, torch.int32),
            seq_lens=torch.from_numpy(context_lens).to(dev, torch.int32),
            block_table=step_table.to(dev), slot_mapping=slots.to(dev),
            query_lens=query_lens.tolist(), context_lens=context_lens.tolist(), block_size=bs,
            prompt_rows=[s.num_prompt_rows for s in sched.seqs])
        return ModelInputs(torch.from_numpy(input_ids).to(dev, copy=True), pos.to(dev, copy=True), meta,
                           torch.from_numpy(logits_index).to(dev))
