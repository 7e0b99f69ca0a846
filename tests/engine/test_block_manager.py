"""Block manager: ref counts, copy-on-write, prefix caching and LRU eviction, plus random-operation properties."""

from __future__ import annotations

from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from heron.engine import block_manager as bm_module
from heron.engine.block_manager import BlockManager
from heron.engine.request import Request, Sequence
from heron.sampling_params import SamplingParams


def make_seq(tokens: list[int]) -> Sequence:
    req = Request("r", list(tokens), SamplingParams(), 0, 0.0)
    return Sequence(req, 0, tokens, None)


def compute(bm: BlockManager, seq: Sequence, n: int) -> None:
    """Simulate the engine computing ``n`` more tokens of ``seq``."""
    assert bm.allocate_slots(seq, n)
    seq.num_computed_tokens += n
    bm.cache_full_blocks(seq)


def test_allocate_and_free_returns_every_block():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(10)))
    compute(bm, seq, 10)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.free(seq)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_fails_without_side_effects_when_full():
    bm = BlockManager(2, 4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2
    bm.check_invariants()


def test_prefix_cache_hit_reuses_blocks_and_counts():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(13)))
    compute(bm, a, 13)
    b = make_seq(list(range(12)) + [99, 98])
    cached = bm.find_cached_prefix(b)
    hits = cached[0]
    assert hits == a.block_table[:3]
    assert bm.allocate_slots(b, len(b) - 12, cached)
    bm.record_prefix_lookup(len(b), len(hits))
    assert b.num_computed_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    assert bm.prefix_hits == 12 and bm.prefix_queries == 14
    assert all(bm.blocks[i].ref_count == 2 for i in a.block_table[:3])
    bm.check_invariants()


def test_full_prompt_hit_leaves_one_token_to_compute():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    b = make_seq(list(range(8)))
    assert len(bm.find_cached_prefix(b)[0]) == 1  # the last block is recomputed so the last token has logits


def test_freed_cached_blocks_survive_until_evicted_lru():
    bm = BlockManager(4, 4)
    a = make_seq(list(range(8)))
    compute(bm, a, 8)
    bm.free(a)
    assert bm.num_free_blocks == 4 and len(bm.evictable) == 2
    b = make_seq(list(range(8)) + [7])
    assert len(bm.find_cached_prefix(b)[0]) == 2  # still cached after free
    # Filling the pool with unrelated tokens evicts the cached blocks.
    c = make_seq([50 + i for i in range(16)])
    compute(bm, c, 16)
    assert bm.find_cached_prefix(b) == ([], [])
    bm.check_invariants()


def test_fork_shares_blocks_and_copy_on_write_on_append():
    bm = BlockManager(8, 4)
    parent = make_seq(list(range(6)))
    compute(bm, parent, 6)
    child = parent.fork(1, None)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    parent.token_ids.append(100)
    assert bm.allocate_slots(parent, 1)
    copies = bm.take_copies()
    assert len(copies) == 1 and copies[0][0] == child.block_table[1]
    assert parent.block_table[1] != child.block_table[1]
    assert parent.block_table[0] == child.block_table[0]
    # The child is now the only owner of the original last block: it writes in place.
    child.token_ids.append(200)
    assert bm.allocate_slots(child, 1) and bm.take_copies() == []
    bm.check_invariants()


def test_forced_hash_collision_never_shares_another_contexts_blocks():
    """With every digest equal, a lookup must still find only blocks of the very same context."""
    with mock.patch.object(bm_module, "block_hash", lambda parent, tokens: b"same"):
        bm = BlockManager(16, 4)
        a = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 9])
        compute(bm, a, 9)
        # the same first block, then a block whose tokens match a's *first* block at another position
        b = make_seq([1, 1, 1, 1, 1, 1, 1, 1, 9])
        assert bm.find_cached_prefix(b)[0] == a.block_table[:1]
        # a different first block: no hit at all, although the digests collide
        c = make_seq([3, 3, 3, 3, 2, 2, 2, 2, 9])
        assert bm.find_cached_prefix(c) == ([], [])
        # a's exact prefix is still found, block for block
        d = make_seq([1, 1, 1, 1, 2, 2, 2, 2, 5])
        assert bm.find_cached_prefix(d)[0] == a.block_table[:1]  # block 1 collides with block 0 in the map
        bm.check_invariants()


def test_chained_digest_finds_a_long_prefix_and_hashes_only_new_blocks():
    bm = BlockManager(16, 4)
    a = make_seq(list(range(13)))
    calls = []
    real = bm_module.block_hash
    with mock.patch.object(bm_module, "block_hash", lambda p, t: calls.append(1) or real(p, t)):
        compute(bm, a, 5)
        compute(bm, a, 3)
        compute(bm, a, 5)
    assert len(calls) == 3  # one digest per newly filled block, none recomputed
    b = make_seq(list(range(12)) + [77])
    assert bm.find_cached_prefix(b)[0] == a.block_table[:3]


def test_truncate_rolls_back_draft_slots():
    bm = BlockManager(8, 4)
    seq = make_seq(list(range(6)))
    compute(bm, seq, 6)
    assert bm.allocate_slots(seq, 5)  # room for the last token and 4 drafts: positions 6..10
    assert len(seq.block_table) == 3
    seq.token_ids.append(42)  # one draft accepted: 7 tokens, the 7th computed next step
    bm.truncate(seq, len(seq))
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "grow", "fork", "free"]), st.integers(0, 50),
                          st.integers(1, 9)), max_size=40))
def test_random_operations_keep_invariants(ops):
    bm = BlockManager(24, 4)
    live: list[Sequence] = []
    for op, pick, n in ops:
        if op == "new":
            seq = make_seq([pick % 5] * n)  # few distinct tokens, so prefixes repeat
            cached = bm.find_cached_prefix(seq)
            if bm.allocate_slots(seq, len(seq) - len(cached[0]) * 4, cached):
                seq.num_computed_tokens = len(seq)
                bm.cache_full_blocks(seq)
                live.append(seq)
        elif live and op == "grow":
            seq = live[pick % len(live)]
            seq.token_ids.extend([pick % 3] * n)
            if bm.allocate_slots(seq, n):
                seq.num_computed_tokens += n
                bm.cache_full_blocks(seq)
            else:
                del seq.token_ids[-n:]
            bm.take_copies()
        elif live and op == "fork":
            parent = live[pick % len(live)]
            child = parent.fork(len(live), None)
            bm.fork(parent, child)
            live.append(child)
        elif live and op == "free":
            bm.free(live.pop(pick % len(live)))
        bm.check_invariants()
        refs = [0] * bm.num_blocks
        for seq in live:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
            for b in seq.block_table:
                refs[b] += 1
        assert refs == [b.ref_count for b in bm.blocks]
    for seq in live:
        bm.free(seq)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks
