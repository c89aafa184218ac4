"""The pool of KV-cache blocks: which block ids are free and who holds the rest.

A block is one `block_size`-token slice of every layer's K and V tensors. The pool only
hands out ids; the tensors live in the model runner. Every holder of a block (a running
request, the prefix cache) owns one reference; the block returns to the free list when the
last reference is dropped. That is what lets several sequences share a prompt prefix.

The prefix cache's references are marked as such, so the pool can say at any moment how many
blocks are held by the cache alone (`num_cached_only`): those are evictable, so a metric of
memory in use counts them apart, as vLLM counts them as free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

# A block's state in `BlockPool.states`.
FREE, HELD, SHARED_WITH_CACHE, CACHED_ONLY = b"f", b"u", b"s", b"c"


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free. Callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._held_by_cache = [False] * num_blocks  # the prefix cache holds one of the references
        self.num_cached_only = 0  # blocks whose only reference is the prefix cache's
        self._states = bytearray(FREE * num_blocks)  # each block's state (`states`), kept in step

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks someone holds, the prefix cache included."""
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def states(self) -> str:
        """One character per block id, for the engine view: "f" free, "u" held by sequences,
        "s" held by sequences and by the prefix cache, "c" held only by the prefix cache. Kept
        up to date as references change, so that reading it costs a copy, not a pass in Python
        over the pool (which cost a snapshot of a large pool most of its time)."""
        return self._states.decode("ascii")

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with one reference held by the caller."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._set_count(block_id, 1, was_cached_only=False)
        return blocks

    def incref(self, block_ids: Iterable[int], by_cache: bool = False) -> None:
        """Add a reference to blocks someone else already holds (sharing a prefix).
        `by_cache`: the reference is the prefix cache's (it holds at most one per block)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} is free; allocate it instead of sharing it")
            was_cached_only = self._cached_only(block_id)
            if by_cache:
                if self._held_by_cache[block_id]:
                    raise ValueError(f"block {block_id} is already held by the prefix cache")
                self._held_by_cache[block_id] = True
            self._set_count(block_id, count + 1, was_cached_only)

    def free(self, block_ids: Iterable[int], by_cache: bool = False) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free list.
        `by_cache`: the reference dropped is the prefix cache's."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} freed twice")
            was_cached_only = self._cached_only(block_id)
            if by_cache:
                if not self._held_by_cache[block_id]:
                    raise ValueError(f"block {block_id} is not held by the prefix cache")
                self._held_by_cache[block_id] = False
            self._set_count(block_id, count - 1, was_cached_only)
            if count == 1:
                self._free.append(block_id)

    def _cached_only(self, block_id: int) -> bool:
        return self._ref_counts[block_id] == 1 and self._held_by_cache[block_id]

    def _set_count(self, block_id: int, count: int, was_cached_only: bool) -> None:
        """Store a new reference count, keeping `num_cached_only` and the states in step with it."""
        self._ref_counts[block_id] = count
        self.num_cached_only += self._cached_only(block_id) - was_cached_only
        if self._held_by_cache[block_id]:
            # The cache's reference is one of `count`: a count of 1 is the cache's alone.
            state = CACHED_ONLY if count == 1 else SHARED_WITH_CACHE
        else:
            state = HELD if count else FREE
        self._states[block_id] = state[0]
