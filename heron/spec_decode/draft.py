"""Drafting with a model: a smaller draft model, or the target itself in a cheaper form (self-draft).

The draft's keys and values live in blocks with the *same ids* as the target's: a draft model has a pool of its
own shape with as many blocks (the block manager allocates for both at once, copy-on-write copies both, the
prefix cache serves both); a self-draft of the target's first layers writes into the target's own pool, where
the target rewrites every position it verifies anyway. So nothing here allocates, frees or hashes blocks beyond
reserving the slots of the positions it drafts.

A step of drafting, for every sequence given: reserve its draft slots; catch the draft up on the tokens it has
not seen (a draft model: the prompt at first, then the one or two tokens the last verification accepted past
its drafts; a self-draft of shared layers: only the newest token); then one single-token forward per further
draft. A greedy or seeded request (or any, with ``rejection_sample_method: strict``) drafts the argmax of the draft's
distribution q, which maximizes the chance that the target's own sample equals it; an unseeded sampled request
draws from q (with the request's temperature, top-k/top-p/min-p, penalties and biases applied to it as to the
target's p) and keeps q for the rejection test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from heron.engine.block_manager import BlockManager
from heron.engine.request import Sequence
from heron.engine.scheduler import ScheduledSeq, SchedulerOutput
from heron.sampling.sampler import Sampler, SamplingRow
from heron.sampling.topk_topp import greedy
from heron.worker.model_runner import ModelRunner

DRAFT_SALT = 2  # a seeded request's draft draws: independent of the target's own draw at the same position


@dataclass
class Draft:
    """Draft tokens for one sequence, with the distributions they were sampled from (None: one-hot drafts)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), vocab] float32


class LayerSubset(torch.nn.Module):
    """Some of the target's decoder layers with its embedding, final norm and LM head: a self-draft that shares
    every weight, and the KV pool of the layers it runs, with the target (which rewrites every position it
    verifies)."""

    def __init__(self, model: torch.nn.Module, layer_ids: list[int]) -> None:
        super().__init__()
        self.model = model
        self.layer_ids = layer_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, meta, layer_ids=self.layer_ids, keep=keep)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    def attention_layers(self) -> list:
        layers = self.model.attention_layers()
        return [layers[i] for i in self.layer_ids]


class DraftProposer:
    """Proposes each sequence's next tokens with a draft model run on its own ``ModelRunner``."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, block_manager: BlockManager,
                 copy_blocks: Callable[[list[tuple[int, int]]], None], probabilistic: bool,
                 shares_target_kv: bool) -> None:
        self.runner = runner
        self.sampler = sampler
        self.block_manager = block_manager
        self.copy_blocks = copy_blocks  # copies blocks in every pool (the target's and the draft's)
        self.probabilistic = probabilistic
        self.shares_target_kv = shares_target_kv  # LayerSubset: the target computed every position we read

    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[int, Draft]:
        """Up to ``limits[i]`` draft tokens for ``seqs[i]`` (each past its prompt, its newest token uncomputed)."""
        self._release_rows({s.seq_id for s in seqs})
        active = [(s, n) for s, n in zip(seqs, limits, strict=True)
                  if n > 0 and self.block_manager.allocate_slots(s, n)]
        if not active:
            return {}
        # a copy-on-write for those slots must land before the draft writes into the copy
        self.copy_blocks(self.block_manager.take_copies())
        drafts = {s.seq_id: [] for s, _ in active}
        qs = {s.seq_id: [] for s, _ in active if self._samples(s)}  # q of each sampled draft token
        feeds = [(s, s.token_ids[self._first_uncomputed(s):]) for s, _ in active]
        for step in range(max(n for _, n in active)):
            self._draft_one(feeds, drafts, qs)
            feeds = [(s, [drafts[s.seq_id][-1]]) for s, n in active if n > step + 1]
        return {seq_id: Draft(tokens, torch.stack(qs[seq_id]) if seq_id in qs else None)
                for seq_id, tokens in drafts.items()}

    def _samples(self, seq: Sequence) -> bool:
        """Whether this sequence's drafts are sampled from q (kept for the rejection test), not its argmax. A
        seeded request takes the strict test instead: its tokens are then those of plain decoding, whatever
        its batch companions and whether or not a step speculated."""
        return self.probabilistic and not seq.params.greedy and seq.seed is None

    def _first_uncomputed(self, seq: Sequence) -> int:
        return len(seq) - 1 if self.shares_target_kv else min(seq.num_draft_computed, len(seq) - 1)

    def _draft_one(self, feeds: list[tuple[Sequence, list[int]]], drafts: dict[int, list[int]],
                   qs: dict[int, list[torch.Tensor]]) -> None:
        """One draft forward over ``feeds`` (each sequence's tokens not yet seen by the draft); appends each
        sequence's next draft token (and its q when sampled)."""
        starts = [len(s) + len(drafts[s.seq_id]) - len(tokens) for s, tokens in feeds]
        sched = SchedulerOutput(seqs=[
            ScheduledSeq(s.seq_id, tokens, start, 1, list(s.block_table), True, s.prompt_rows(start, len(tokens)))
            for (s, tokens), start in zip(feeds, starts, strict=True)])
        logits = self.runner.compute_logits(self.runner.execute(sched))
        rows = []
        for s, _ in feeds:
            position = len(s) + len(drafts[s.seq_id])  # of the token drafted now
            s.num_draft_computed = position
            rows.append(SamplingRow(s.params, s.request.prompt_token_ids, s.output_view(drafts[s.seq_id]),
                                    s.generator_for(position, logits.device, DRAFT_SALT)))
        tokens = greedy(self.sampler.process(logits, rows)).tolist()
        sampled = [i for i, (s, _) in enumerate(feeds) if s.seq_id in qs]
        if sampled:
            q = self.sampler.distribution(logits[sampled], [rows[i] for i in sampled])
            for j, i in enumerate(sampled):
                tokens[i] = int(torch.multinomial(q[j], 1, generator=rows[i].generator))
                qs[feeds[i][0].seq_id].append(q[j])
        for (s, _), token in zip(feeds, tokens, strict=True):
            drafts[s.seq_id].append(token)

    def _release_rows(self, keep: set[int]) -> None:
        """Free the runner's rows of sequences not drafting now (finished, preempted, or paused)."""
        stale = [seq_id for seq_id in self.runner.input_batch.row_of if seq_id not in keep]
        if stale:
            self.runner.execute(SchedulerOutput(freed_seq_ids=stale))
