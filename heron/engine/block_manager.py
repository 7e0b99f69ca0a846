"""Owns the KV blocks: free list, reference counts, copy-on-write, automatic prefix caching, rollback.

A full block is named by a SHA-256 digest chained over its parent's digest and its own tokens, so equal
prefixes map to equal chains. A lookup trusts no digest alone: a hit must hold the same tokens *and* name the
block matched just before it as its parent (by a serial number that is never reused), so a hash collision
can only cost a cache miss, never another context's keys and values. A hashed block whose last user is
done stays in an LRU of evictable blocks until an allocation needs it.

Hashing touches only blocks filled since the last step (each sequence keeps its chain), so its cost grows
with the new tokens, not with the context.
"""

from __future__ import annotations

import array
import hashlib
import itertools
from collections import OrderedDict, deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from heron.engine.request import Sequence

_ROOT = b""


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    serial: int = 0  # identity while hashed; never reused, so children can name their parent safely
    parent_serial: int = 0  # 0: the first block of a sequence


def block_hash(parent: bytes, token_ids: Seq[int]) -> bytes:
    """SHA-256 of the parent block's digest and this block's tokens (as vLLM's ``sha256`` prefix hashing)."""
    return hashlib.sha256(parent + array.array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Allocates blocks to sequences; ``pending_copies`` lists (src, dst) copy-on-write copies to run."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref_count 0 but hashed, LRU first
        self.hash_to_block: dict[bytes, int] = {}
        self.pending_copies: list[tuple[int, int]] = []
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._serials = itertools.count(1)

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
    def _tokens(self, seq: Sequence, index: int) -> list[int]:
        return seq.token_ids[index * self.block_size:(index + 1) * self.block_size]

    def find_cached_prefix(self, seq: Sequence) -> tuple[list[int], list[tuple[bytes, int]]]:
        """Block ids holding the longest cached prefix of ``seq`` (at least one token is left to compute),
        and their chain entries."""
        if not self.enable_prefix_caching:
            return [], []
        hits, chain = [], []
        digest, parent_serial = _ROOT, 0
        for i in range((len(seq) - 1) // self.block_size):
            tokens = self._tokens(seq, i)
            digest = block_hash(digest, tokens)
            block_id = self.hash_to_block.get(digest)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if block.parent_serial != parent_serial or block.token_ids != tuple(tokens):
                break  # a digest collision: another context's block
            hits.append(block_id)
            chain.append((digest, block.serial))
            parent_serial = block.serial
        return hits, chain

    def record_prefix_lookup(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count a lookup of ``num_tokens`` tokens of which ``num_hit_blocks`` blocks were found cached."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit_blocks * self.block_size

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Hash the blocks that ``seq``'s computed tokens have filled since the last call."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        for i in range(len(seq.block_chain), num_full):
            parent, parent_serial = seq.block_chain[-1] if seq.block_chain else (_ROOT, 0)
            tokens = tuple(self._tokens(seq, i))
            digest = block_hash(parent, tokens)
            known = self.hash_to_block.get(digest)
            block = self.blocks[seq.block_table[i]]
            if known is None:
                block.hash, block.token_ids = digest, tokens
                block.serial, block.parent_serial = next(self._serials), parent_serial
                self.hash_to_block[digest] = block.block_id
                serial = block.serial
            elif self.blocks[known].token_ids == tokens and self.blocks[known].parent_serial == parent_serial:
                serial = self.blocks[known].serial  # the same context is cached already
            else:
                serial = next(self._serials)  # a collision: this chain stays unreachable, which is safe
            seq.block_chain.append((digest, serial))

    # ---- allocation -------------------------------------------------------------------------------------
    def _take_free_block(self) -> Block:
        if self.free_ids:
            block = self.blocks[self.free_ids.popleft()]
        else:
            block = self.blocks[self.evictable.popitem(last=False)[0]]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.serial, block.parent_serial = None, (), 0, 0
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

    def can_adopt(self, cached_blocks: list[int], num_tokens: int) -> bool:
        """Whether a sequence could take ``cached_blocks`` and room for ``num_tokens`` tokens in all."""
        reusable = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(cached_blocks) <= self.num_free_blocks - reusable

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: tuple[list[int], list] = ((), ())) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``seq`` (after adopting the ``cached`` prefix blocks
        and chain if its table is empty). Returns False, changing nothing, when blocks are short."""
        cached_blocks, chain = cached
        if cached_blocks:
            first_new_pos = len(cached_blocks) * self.block_size
            if not self.can_adopt(list(cached_blocks), first_new_pos + num_new_tokens):
                return False
            for b in cached_blocks:
                self._ref(b)
            seq.block_table, seq.block_chain = list(cached_blocks), list(chain)
            # a draft model's keys and values share the block ids: whoever computed these blocks computed both
            seq.num_computed_tokens = seq.num_draft_computed = first_new_pos
            seq.table_reset = True
        first_new_pos = seq.num_computed_tokens
        needed = max(0, self.blocks_needed(first_new_pos + num_new_tokens) - len(seq.block_table))
        cow = self._needs_copy(seq, first_new_pos)
        if needed + int(cow) > self.num_free_blocks:
            return False
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
        seq.table_reset = True
        self.pending_copies.append((src, dst))

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Let ``child`` share every block of ``parent``; the first write to a shared block copies it."""
        for b in parent.block_table:
            self._ref(b)
        child.block_table = list(parent.block_table)
        child.table_reset = True

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Keep only the blocks that ``num_tokens`` tokens need (roll back slots of rejected draft tokens)."""
        keep = self.blocks_needed(num_tokens)
        for b in reversed(seq.block_table[keep:]):
            self._unref(b)
        del seq.block_table[keep:]
        del seq.block_chain[keep:]
        seq.num_sent_blocks = min(seq.num_sent_blocks, keep)
        seq.table_reset = True

    def free(self, seq: Sequence) -> None:
        """Release the blocks of ``seq``; tail blocks go first into the LRU, so they are evicted first."""
        for b in reversed(seq.block_table):
            self._unref(b)
        seq.block_table = []
        seq.block_chain = []
        seq.table_reset = True

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def reset_prefix_cache(self) -> None:
        """Forget every evictable cached block (used blocks keep their hashes)."""
        for block_id in list(self.evictable):
            block = self.blocks[block_id]
            del self.hash_to_block[block.hash]
            block.hash, block.token_ids, block.serial, block.parent_serial = None, (), 0, 0
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
