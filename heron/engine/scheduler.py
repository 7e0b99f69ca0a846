"""Continuous batching: every step admits and retires sequences under a token budget.

Running sequences are served first (a decode token each, or the next chunk of an unfinished prefill), then
waiting ones are admitted, FCFS within priority, with their prompt chunked to fit the budget. When blocks run
out, the lowest-priority, newest running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from heron.config import EngineConfig
from heron.engine.block_manager import BlockManager
from heron.engine.sequence import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


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

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def add_running(self, seq: Sequence) -> None:
        """Adopt a forked sequence that already shares its parent's computed blocks."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(out, budget)
        budget -= out.num_tokens
        if not preempted:
            self._schedule_waiting(out, budget)
        out.block_copies = self.block_manager.take_copies()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> bool:
        preempted = False
        # Decode tokens first, then unfinished prefill chunks, so a long prompt never stalls the others.
        queue = sorted(self.running, key=lambda s: (len(s) - s.num_computed_tokens > 1, s.sort_key))
        while queue and budget > 0:
            seq = queue.pop(0)
            num_new = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                preempted = True
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return preempted

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = [] if seq.params.prompt_logprobs is not None else self.block_manager.find_cached_prefix(seq)
            remaining = len(seq) - len(cached) * self.block_manager.block_size
            if remaining > budget and not self.chunked_prefill:
                break
            num_new = min(remaining, budget)
            if not self.block_manager.allocate_slots(seq, num_new, cached):
                break
            self.block_manager.record_prefix_lookup(len(seq), len(cached))
            if seq.request.metrics.first_scheduled_time is None:
                seq.request.num_cached_tokens = len(cached) * self.block_manager.block_size
            self.waiting.pop(0)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        self.num_preemptions += 1
        self.add(seq)

    def finish(self, seq: Sequence) -> None:
        """Retire ``seq`` (finished or aborted) wherever it is, freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SeqStatus.FINISHED
