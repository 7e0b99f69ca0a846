"""Owns the KV blocks: free list, reference counts, copy-on-write and automatic prefix caching.

A full block is named by a hash of its tokens chained with its parent block's hash, so equal prefixes map to
equal hash chains. When its last user frees a hashed block it stays in an LRU of evictable blocks and can be
reused by a later request with the same prefix until a new allocation evicts it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from heron.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


def block_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent, token_ids))


class BlockManager:
    """Allocates blocks to sequences; ``pending_copies`` lists (src, dst) copy-on-write copies to run."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref_count 0 but hashed, LRU first
        self.hash_to_block: dict[int, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- accounting -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids) + len(self.evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # ---- prefix cache -----------------------------------------------------------------------------------
    def _chain_hashes(self, token_ids: list[int], num_blocks: int) -> list[int]:
        hashes, parent = [], None
        for i in range(num_blocks):
            parent = block_hash(parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]))
            hashes.append(parent)
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq`` (at least one token is left to compute)."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        hits = []
        for i, h in enumerate(self._chain_hashes(seq.token_ids, max_blocks)):
            block_id = self.hash_to_block.get(h)
            tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count a lookup of ``num_tokens`` tokens of which ``num_hit_blocks`` blocks were found cached."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_blocks * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks of ``seq`` that its computed tokens have filled, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        parent = None
        for i in range(num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                h = block_hash(parent, tokens)
                if h not in self.hash_to_block:
                    block.hash, block.token_ids = h, tokens
                    self.hash_to_block[h] = block.block_id
                parent = h
            else:
                parent = block.hash

    # ---- allocation -------------------------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        else:
            block = self.blocks[self.evictable.popitem(last=False)[0]]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
        assert block.ref_count == 0
        block.ref_count = 1
        return block

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            self.evictable.pop(block_id)
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            if block.hash is not None:
                self.evictable[block_id] = None
            else:
                self.free_ids.append(block_id)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached_blocks: list[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after adopting ``cached_blocks`` if its
        table is empty). Returns False, changing nothing, when there are not enough free blocks."""
        cached = list(cached_blocks)
        reusable = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        have = len(seq.block_table) or len(cached)
        first_new_pos = len(cached) * self.block_size if cached else seq.num_computed_tokens
        needed = max(0, self.blocks_needed(first_new_pos + num_new_tokens) - have)
        cow = self._needs_copy(seq, first_new_pos) if not cached else False
        if needed + int(cow) > self.num_free_blocks - reusable:
            return False
        for b in cached:
            self._ref(b)
        if cached:
            seq.block_table = cached
            seq.num_computed_tokens = len(cached) * self.block_size
        if cow:
            self._copy_on_write(seq, first_new_pos // self.block_size)
        for _ in range(needed):
            seq.block_table.append(self._take_free_block().block_id)
        return True

    def _needs_copy(self, seq: Sequence, first_new_pos: int) -> bool:
        idx = first_new_pos // self.block_size
        return idx < len(seq.block_table) and self.blocks[seq.block_table[idx]].ref_count > 1

    def _copy_on_write(self, seq: Sequence, idx: int) -> None:
        src = seq.block_table[idx]
        dst = self._take_free_block().block_id
        self._unref(src)
        seq.block_table[idx] = dst
        self.pending_copies.append((src, dst))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent``; the first write to a shared block copies it."""
        for b in parent.block_table:
            self._ref(b)
        child.block_table = list(parent.block_table)

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``; tail blocks go first into the LRU, so they are evicted first."""
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table = []

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (used blocks keep their hashes)."""
        for block_id in list(self.evictable):
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, ()
            self.free_ids.append(block_id)
        self.evictable.clear()

    def check_invariants(self) -> None:
        """Assert that ref counts, the free list, the LRU and the hash map agree (for tests)."""
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "duplicate ids in the free list"
        assert not free & set(self.evictable), "a block is both free and evictable"
        for block in self.blocks:
            in_pool = block.block_id in free or block.block_id in self.evictable
            assert (block.ref_count == 0) == in_pool, f"block {block.block_id}: ref {block.ref_count}"
            if block.block_id in self.evictable:
                assert block.hash is not None
            if block.hash is not None:
                assert self.hash_to_block[block.hash] == block.block_id
        assert len(self.hash_to_block) == sum(b.hash is not None for b in self.blocks)
