"""A radix-tree prefix cache over the paged KV pool (the idea behind SGLang's RadixAttention).

Finished (or prefilled) requests hand their full KV blocks to the tree, keyed by the tokens they
hold. A later request whose prompt starts with the same tokens gets those blocks back from
`match_prefix` and skips recomputing them.

Caching is block-granular: only full blocks of `block_size` tokens are keyed, and every edge holds
a whole number of blocks. Each child is found in its parent's dict by the tokens of its FIRST block,
so siblings always differ in their first block and a lookup costs one dict probe per edge.

Layout with block_size = 2, after inserting [1 2 3 4 5 6] on blocks [7 8 9] and then
[1 2 3 4 9 9] on blocks [3 4 5]. The second insert shares the first two blocks' worth of tokens
([1 2 3 4] → blocks 7 8), so the original edge is split at that block boundary; block 3 and 4 (the
caller's duplicates of 7 and 8) are not adopted, only block 5 is:

    root
     └─ key (1, 2)  tokens [1 2 | 3 4]   blocks [7, 8]
         ├─ key (5, 6)  tokens [5 6]     blocks [9]      ← leaf
         └─ key (9, 9)  tokens [9 9]     blocks [5]      ← leaf

A block's KV depends on every token before it, so a block is only meaningful at the end of the
path from the root that leads to it; that is why eviction only ever trims the ends of leaves.

Namespaces: the tree has one root per namespace (any hashable value; the scheduler's is the
request's tenant and `cache_salt`), and a prompt is matched only against prefixes inserted in its
own namespace. Sharing KV across namespaces would save compute, but a hit is visible (a faster
first token, `cached_tokens`), so one client could learn whether another already sent a prompt.
Eviction is one LRU order over every namespace; a root left without children is dropped.

Ownership: `BlockPool` counts references. The tree holds exactly one on each block it caches; each
request holds its own. A cached block whose count is 1 is held only by the tree and may be evicted.
This module is pure Python and must never import torch.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

from yaie.cache.block_pool import BlockPool


class _Node:
    """One edge of the tree plus the node at its lower end.

    `tokens` is the edge's token run (a multiple of block_size long, except on the root, where it is
    empty) and `blocks` holds one block id per block_size tokens of it.
    """

    __slots__ = ("blocks", "children", "heap_id", "hits", "last_access", "parent", "tokens")

    def __init__(self, tokens: tuple[int, ...], blocks: list[int], parent: _Node | None, stamp: int) -> None:
        self.tokens = tokens
        self.blocks = blocks
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.last_access = stamp
        self.hits = 0  # how many match_prefix calls reused (part of) this edge
        # Id of this node's one valid eviction-heap entry; older entries for it are stale (see _push_leaf).
        self.heap_id = -1


class _Root(_Node):
    """The root of one namespace's tree: no tokens, no blocks, no parent."""

    __slots__ = ("namespace",)

    def __init__(self, namespace: Hashable) -> None:
        super().__init__((), [], None, 0)
        self.namespace = namespace


@dataclass(frozen=True)
class NodeView:
    """One node of the tree as `top_levels` shows it: read-only, for the engine view."""

    parent: int  # index of the parent in the same list; -1 under the root
    depth: int  # 1 for the root's children
    start: int  # tokens from the root to the start of this edge
    tokens: tuple[int, ...]  # the edge's tokens
    blocks: list[int]  # one block id per block_size tokens of them
    hits: int
    num_children: int


class RadixCache:
    def __init__(self, pool: BlockPool, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._clock = 0
        self._roots: dict[Hashable, _Root] = {}  # by namespace
        self._cached: set[int] = set()
        self._num_nodes = 0  # excluding the roots
        # Min-heap of (last_access, heap_id, node) over leaves, with lazy deletion: entries are never
        # removed when a node is touched, gains a child or is detached; they are skipped when popped
        # because their heap_id no longer matches the node's. heap_id also breaks ties in last_access.
        self._heap: list[tuple[int, int, _Node]] = []
        self._next_heap_id = 0
        self.num_evicted_blocks = 0  # since the start, for the engine view's events

    # ---------------------------------------------------------------- public API

    @property
    def num_cached_blocks(self) -> int:
        """Blocks the tree holds a reference on."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks only the tree holds (ref count 1) that `evict` can actually free right now.

        A tree-only block that sits above a block some request still holds (same edge further down,
        or a descendant) is not counted: freeing it would cut the held block off from the root, so
        `evict` leaves it until that request lets go. So `evict(n)` frees exactly
        `min(n, num_evictable_blocks)`. Costs one walk over the tree.
        """
        total = 0
        # Iterative post-order (the tree can be deeper than Python's recursion limit).
        # whole[node] says every block in node's subtree, its own edge included, is tree-only.
        whole: dict[int, bool] = {}
        for node in self._post_order():
            children_whole = all([whole.pop(id(child)) for child in node.children.values()])
            if not children_whole:
                whole[id(node)] = False
                continue
            trailing = self._count_tree_only_tail(node.blocks, len(node.blocks))
            total += trailing
            whole[id(node)] = trailing == len(node.blocks)
        return total

    def match_prefix(self, token_ids: Sequence[int], namespace: Hashable = None) -> list[int]:
        """Block ids of the longest block-aligned prefix of token_ids cached in `namespace`.

        Takes one pool reference on each returned block for the caller (release with pool.free)
        and marks the matched path as recently used.
        """
        bs = self.block_size
        n_blocks = len(token_ids) // bs
        matched: list[int] = []
        path: list[_Node] = []
        node: _Node | None = self._roots.get(namespace)
        if node is None:
            return matched
        pos = 0  # in blocks
        while pos < n_blocks:
            child = node.children.get(tuple(token_ids[pos * bs : (pos + 1) * bs]))
            if child is None:
                break
            k = self._common_blocks(child, token_ids, pos, n_blocks)
            matched.extend(child.blocks[:k])
            path.append(child)
            pos += k
            if k < len(child.blocks):
                # Diverged (or ran out of full blocks) inside this edge. No split here: match
                # only reads the tree; insert splits when it actually has something to add.
                break
            node = child
        if path:
            self._touch(path)
        for child in path:
            child.hits += 1
        self.pool.incref(matched)
        return matched

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], namespace: Hashable = None) -> int:
        """Cache the full blocks of token_ids that block_ids covers, in `namespace`; return the
        tokens already cached there.

        Blocks the tree already holds for the same prefix are kept; the caller's duplicates are not
        adopted (the caller frees its own copies). New blocks get one tree reference each.
        """
        bs = self.block_size
        n_blocks = min(len(block_ids), len(token_ids) // bs)
        if n_blocks == 0:
            return 0
        node: _Node = self._roots.setdefault(namespace, _Root(namespace))
        path: list[_Node] = []
        pos = 0
        while pos < n_blocks:
            key = tuple(token_ids[pos * bs : (pos + 1) * bs])
            child = node.children.get(key)
            if child is None:
                new_blocks = list(block_ids[pos:n_blocks])
                self._check_adoptable(new_blocks)
                self.pool.incref(new_blocks, by_cache=True)
                self._cached.update(new_blocks)
                leaf = _Node(tuple(token_ids[pos * bs : n_blocks * bs]), new_blocks, node, self._clock)
                node.children[key] = leaf
                self._num_nodes += 1
                path.append(leaf)
                break
            k = self._common_blocks(child, token_ids, pos, n_blocks)
            if k < len(child.blocks):
                child = self._split(child, k)
            path.append(child)
            pos += k
            node = child
        if path:
            self._touch(path)
        return pos * bs

    def evict(self, num_blocks: int) -> int:
        """Free up to num_blocks tree-only blocks, least recently used leaves first.

        Trims blocks off the END of a leaf's edge (a block's KV is only usable after all the blocks
        before it, so the tail is what can go); a leaf emptied this way is removed, and its parent may
        become the next leaf. Returns how many blocks went back to the free list.
        """
        freed = 0
        blocked: list[_Node] = []
        while freed < num_blocks and self._heap:
            _, heap_id, node = heapq.heappop(self._heap)
            if heap_id != node.heap_id or node.children or node.parent is None:
                continue  # stale entry: node was touched, gained a child, or left the tree
            blocks = node.blocks
            k = self._count_tree_only_tail(blocks, num_blocks - freed)
            if k:
                victims = blocks[len(blocks) - k :]
                self.pool.free(victims, by_cache=True)  # each had ref count 1, so each goes to the free list
                self._cached.difference_update(victims)
                freed += k
                self.num_evicted_blocks += k
                if k == len(blocks):
                    self._detach(node)
                    continue
                node.blocks = blocks[: len(blocks) - k]
                node.tokens = node.tokens[: len(node.blocks) * self.block_size]
            # Still a leaf with blocks: either its tail is held by a request or we reached
            # num_blocks. Set it aside (re-pushing now would pop it again in this loop).
            blocked.append(node)
        for node in blocked:
            self._push_leaf(node)
        return freed

    def top_levels(self, depth: int, limit: int, namespace: Hashable = None) -> list[NodeView]:
        """The first `depth` levels of `namespace`'s tree, breadth first, at most `limit` nodes:
        what the engine view draws. Copies only the block lists; the token tuples are shared
        (immutable)."""
        views: list[NodeView] = []
        root = self._roots.get(namespace)
        children = [] if root is None else root.children.values()
        queue = deque((child, -1, 1, 0) for child in children)
        while queue and len(views) < limit:
            node, parent, level, start = queue.popleft()
            index = len(views)
            views.append(
                NodeView(parent, level, start, node.tokens, list(node.blocks), node.hits, len(node.children))
            )
            if level < depth:
                end = start + len(node.tokens)
                queue.extend((child, index, level + 1, end) for child in node.children.values())
        return views

    def reset(self) -> None:
        """Drop every tree reference; blocks that requests still hold stay held."""
        for node in self._post_order():
            self.pool.free(node.blocks, by_cache=True)  # a root's list is empty
        self._roots.clear()
        self._cached.clear()
        self._num_nodes = 0
        self._heap.clear()

    # ---------------------------------------------------------------- internals

    def _common_blocks(self, child: _Node, token_ids: Sequence[int], pos: int, n_blocks: int) -> int:
        """How many whole blocks of child's edge equal token_ids from block `pos` on (at least 1:
        the caller found child by its first block)."""
        bs = self.block_size
        limit = min(len(child.blocks), n_blocks - pos)
        k = 1
        edge = child.tokens
        while k < limit:
            start = (pos + k) * bs
            if edge[k * bs : (k + 1) * bs] != tuple(token_ids[start : start + bs]):
                break
            k += 1
        return k

    def _split(self, child: _Node, k: int) -> _Node:
        """Split child's edge after its first k blocks and return the new upper node.

        The lower part keeps the original node object so any heap entry for it stays valid, and
        its dict key under the new node is its new first block.
        """
        bs = self.block_size
        parent = child.parent
        assert parent is not None and 0 < k < len(child.blocks)
        upper = _Node(child.tokens[: k * bs], child.blocks[:k], parent, child.last_access)
        upper.hits = child.hits  # every hit on the edge was a hit on its first part
        child.tokens = child.tokens[k * bs :]
        child.blocks = child.blocks[k:]
        child.parent = upper
        upper.children[child.tokens[:bs]] = child
        parent.children[upper.tokens[:bs]] = upper  # same first block, so same key as before
        self._num_nodes += 1
        return upper

    def _touch(self, path: list[_Node]) -> None:
        """Stamp every node on path as used now.

        Stamping the whole path keeps parent.last_access >= child.last_access, so a leaf is always
        the least recent node of its subtree and LRU order over leaves is LRU order over the tree.
        """
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        last = path[-1]
        if not last.children:
            self._push_leaf(last)

    def _push_leaf(self, node: _Node) -> None:
        self._next_heap_id += 1
        node.heap_id = self._next_heap_id
        heapq.heappush(self._heap, (node.last_access, node.heap_id, node))
        # Every match of a leaf adds an entry, so stale ones pile up if evict seldom runs.
        # Rebuild from the current leaves when the heap gets much bigger than the tree.
        if len(self._heap) > 4 * self._num_nodes + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = []
        for node in self._post_order():
            if node.parent is not None and not node.children:
                self._next_heap_id += 1
                node.heap_id = self._next_heap_id
                self._heap.append((node.last_access, node.heap_id, node))
        heapq.heapify(self._heap)

    def _detach(self, node: _Node) -> None:
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self.block_size]]
        node.parent = None
        self._num_nodes -= 1
        if parent.children:
            return
        if isinstance(parent, _Root):
            del self._roots[parent.namespace]  # an empty namespace costs nothing to forget
        else:
            self._push_leaf(parent)  # it is a leaf now, so it can be evicted in turn

    def _count_tree_only_tail(self, blocks: list[int], limit: int) -> int:
        """Length of the run of tree-only blocks (ref count 1) at the end of blocks, capped at limit."""
        k = 0
        n = len(blocks)
        while k < limit and k < n and self.pool.ref_count(blocks[n - 1 - k]) == 1:
            k += 1
        return k

    def _check_adoptable(self, blocks: list[int]) -> None:
        # Checked before any incref so a bad call leaves the pool and tree untouched.
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"insert got the same block twice: {blocks}")
        for block_id in blocks:
            if block_id in self._cached:
                raise ValueError(f"block {block_id} is already cached for a different prefix")
            if self.pool.ref_count(block_id) == 0:
                raise ValueError(f"block {block_id} is free; the caller must hold the blocks it inserts")

    def _post_order(self) -> Iterator[_Node]:
        """Every node, the roots included, children before parents, without recursion."""
        stack: list[tuple[_Node, bool]] = [(root, False) for root in self._roots.values()]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                yield node
            else:
                stack.append((node, True))
                stack.extend((child, False) for child in node.children.values())
