"""The pool of KV-cache blocks: which block ids are free and who holds the rest.

A block is one `block_size`-token slice of every layer's K and V tensors. The pool only
hands out ids; the tensors live in the model runner. Every holder of a block (a running
request, the prefix cache) owns one reference; the block returns to the free list when the
last reference is dropped. That is what lets several requests share a prompt prefix.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than are free. Callers check `num_free` first."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def allocate(self, count: int) -> list[int]:
        """Take `count` free blocks, each with one reference held by the caller."""
        if count > len(self._free):
            raise NoFreeBlocksError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add a reference to blocks someone else already holds (sharing a prefix)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"block {block_id} is free; allocate it instead of sharing it")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
