"""Continuous batching: every step decides how many tokens each sequence computes, under a token budget.

A sequence asks for ``num_pending_tokens``: the rest of its prompt (chunked to the budget), one decode
token, or one token plus its drafts to verify; all are the same thing with different counts. Running
sequences go first (decodes before prefill chunks, so a long prompt never stalls the others), then waiting
ones are admitted in (priority, arrival) order. When blocks run out, the lowest-priority, newest running
sequence is preempted: its blocks are freed and it is recomputed later.

The result is plain data (``SchedulerOutput``): the model runner never touches a ``Sequence``. Progress is
guaranteed because the pool holds at least one ``max_model_len`` sequence (checked at start): the
highest-priority sequence can always run once the others are preempted.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from heron.config import EngineConfig
from heron.engine.block_manager import BlockManager
from heron.engine.request import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    """What one sequence computes this step: ``token_ids`` at positions ``start_pos...``; the final hidden
    states (for logits, or pooling) of the last ``num_logits`` of them are wanted. ``block_ids`` extend the
    runner's block-table row, or replace it when ``reset``."""

    seq_id: int
    token_ids: list[int]
    start_pos: int
    num_logits: int
    block_ids: list[int]
    reset: bool
    num_prompt_rows: int = 0  # how many of ``token_ids`` (the first ones) are prompt tokens


@dataclass
class SchedulerOutput:
    """One step's work, as plain data (the same message can feed tensor-parallel workers)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    freed_seq_ids: list[int] = field(default_factory=list)  # runner rows to release (finished or preempted)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst) blocks

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


class Scheduler:
    """Holds the waiting and running queues and decides what each engine step computes."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.chunked_prefill = config.enable_chunked_prefill
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []  # sorted by Sequence.sort_key
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._freed: list[int] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a forked sequence that already shares its parent's computed blocks."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> tuple[SchedulerOutput, dict[int, Sequence]]:
        """Plan one step; returns the plain-data output and, for the core, the scheduled sequences by id."""
        chosen: dict[Sequence, int] = {}
        budget = self._schedule_running(chosen, self.max_num_batched_tokens)
        if not self._freed_by_preemption:
            self._schedule_waiting(chosen, budget)
        out = SchedulerOutput(freed_seq_ids=self._freed, block_copies=self.block_manager.take_copies())
        self._freed = []
        for seq, n in chosen.items():
            out.seqs.append(self._describe(seq, n))
        return out, {seq.seq_id: seq for seq in chosen}

    def _schedule_running(self, chosen: dict[Sequence, int], budget: int) -> int:
        self._freed_by_preemption = False
        order = sorted(self.running, key=lambda s: (s.num_pending_tokens > 1 + len(s.spec_token_ids), s.sort_key))
        for seq in order:
            if budget <= 0:
                break
            if seq.status != SeqStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(seq.num_pending_tokens, budget)
            if num_new < seq.num_pending_tokens and seq.spec_token_ids:
                seq.clear_drafts()  # no room to verify drafts this step: decode plainly
                num_new = min(seq.num_pending_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = max(self.running, key=lambda s: s.sort_key)
                budget += chosen.pop(victim, 0)
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chosen[seq] = num_new
                budget -= num_new
        return budget

    def _schedule_waiting(self, chosen: dict[Sequence, int], budget: int) -> None:
        bm = self.block_manager
        seats_taken = sum(self._seats(s) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seats_taken + self._seats(seq) > self.max_num_seqs:
                break
            cached = ([], []) if seq.request.bypasses_prefix_cache else bm.find_cached_prefix(seq)
            remaining = len(seq) - len(cached[0]) * bm.block_size
            if remaining > budget and not self.chunked_prefill:
                break
            num_new = min(remaining, budget)
            if not bm.allocate_slots(seq, num_new, cached):
                break
            bm.record_prefix_lookup(len(seq), len(cached[0]))
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = len(cached[0]) * bm.block_size
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            seats_taken += self._seats(seq)
            chosen[seq] = num_new
            budget -= num_new

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running slots ``seq`` takes: its samples still to be forked count too, so ``n > 1`` respects
        ``--max-num-seqs``."""
        req = seq.request
        return 1 + (req.params.n - len(req.seqs) if seq.index == 0 and len(req.seqs) < req.params.n else 0)

    def _describe(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        tokens = seq.token_ids[start:start + num_new]
        if len(tokens) < num_new:
            tokens += seq.spec_token_ids[:num_new - len(tokens)]
        num_logits = 0
        if start + num_new == len(seq) + len(seq.spec_token_ids):
            num_logits = 1 + len(seq.spec_token_ids)
        if seq.index == 0 and seq.request.wants_prompt_rows and start < seq.num_prompt_tokens:
            num_logits = num_new
        reset = seq.table_reset
        blocks = seq.block_table if reset else seq.block_table[seq.num_sent_blocks:]
        seq.table_reset, seq.num_sent_blocks = False, len(seq.block_table)
        return ScheduledSeq(seq.seq_id, tokens, start, num_logits, list(blocks), reset,
                            seq.prompt_rows(start, num_new))

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.clear_drafts()
        self.num_preemptions += 1
        self._freed.append(seq.seq_id)
        self._freed_by_preemption = True
        self.add(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (finished, aborted or failed) wherever it is, freeing its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
            self._freed.append(seq.seq_id)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
