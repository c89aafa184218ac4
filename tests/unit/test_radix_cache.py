"""Tests for the radix-tree prefix cache. Pure Python: no torch."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache, _Node

BS = 2  # block size used by the unit tests


def make(num_blocks: int = 16, block_size: int = BS) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool, block_size)


def cache_seq(pool: BlockPool, cache: RadixCache, tokens: list[int]) -> list[int]:
    """Allocate blocks for tokens as a request would, insert them, release the request's refs."""
    blocks = pool.allocate(len(tokens) // cache.block_size)
    cache.insert(tokens, blocks)
    pool.free(blocks)
    return blocks


def edges(cache: RadixCache) -> dict[tuple[int, ...], list[int]]:
    """Full root-to-node token path → that node's edge blocks, for every node."""
    out: dict[tuple[int, ...], list[int]] = {}
    stack: list[tuple[_Node, tuple[int, ...]]] = [(root, ()) for root in cache._roots.values()]
    while stack:
        node, prefix = stack.pop()
        for child in node.children.values():
            path = prefix + child.tokens
            out[path] = list(child.blocks)
            stack.append((child, path))
    return out


# ------------------------------------------------------------------ unit tests


def test_empty_cache_matches_nothing() -> None:
    pool, cache = make()
    assert cache.match_prefix([1, 2, 3, 4]) == []
    assert cache.match_prefix([]) == []
    assert cache.num_cached_blocks == 0
    assert cache.num_evictable_blocks == 0
    assert cache.evict(5) == 0
    assert pool.num_free == pool.num_blocks


def test_exact_match_returns_blocks_and_takes_refs() -> None:
    pool, cache = make()
    blocks = pool.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], blocks) == 0
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2]  # request + tree
    pool.free(blocks)  # request finishes
    assert [pool.ref_count(b) for b in blocks] == [1, 1, 1]
    assert cache.num_cached_blocks == 3
    assert cache.num_evictable_blocks == 3

    got = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert got == blocks
    assert [pool.ref_count(b) for b in blocks] == [2, 2, 2]  # the caller got its references
    assert cache.num_evictable_blocks == 0
    pool.free(got)
    assert cache.num_evictable_blocks == 3
    assert pool.num_free == pool.num_blocks - 3


def test_longer_query_matches_cached_prefix() -> None:
    pool, cache = make()
    blocks = cache_seq(pool, cache, [1, 2, 3, 4])
    got = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert got == blocks
    pool.free(got)


def test_partial_blocks_are_not_matched() -> None:
    pool, cache = make(block_size=4)
    blocks = cache_seq(pool, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    # Query shorter than one block: nothing, even though its tokens are cached.
    assert cache.match_prefix([1, 2, 3]) == []
    # 7 tokens: only the first full block counts.
    got = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert got == blocks[:1]
    pool.free(got)
    # Differs inside the second block: only the first block matches.
    got = cache.match_prefix([1, 2, 3, 4, 5, 6, 7, 9])
    assert got == blocks[:1]
    pool.free(got)
    # A trailing partial block in an insert is not cached.
    pool2, cache2 = make(block_size=4)
    b = pool2.allocate(2)
    assert cache2.insert([1, 2, 3, 4, 5, 6], b) == 0
    assert cache2.num_cached_blocks == 1
    assert pool2.ref_count(b[1]) == 1  # not adopted


def test_insert_splits_at_block_boundary() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2, 3, 4, 5, 6])
    b = pool.allocate(3)
    # Shares [1 2 3 4], then diverges; also diverges mid-block would still split at the boundary.
    assert cache.insert([1, 2, 3, 4, 9, 9], b) == 4
    assert edges(cache) == {
        (1, 2, 3, 4): a[:2],
        (1, 2, 3, 4, 5, 6): a[2:],
        (1, 2, 3, 4, 9, 9): b[2:],
    }
    assert cache.num_cached_blocks == 4
    # The duplicate blocks were not adopted; only b[2] was.
    assert [pool.ref_count(x) for x in b] == [1, 1, 2]
    pool.free(b)
    assert pool.num_free == pool.num_blocks - 4

    got = cache.match_prefix([1, 2, 3, 4, 9, 9, 0])
    assert got == a[:2] + b[2:]
    pool.free(got)

    # Diverging in the middle of a block splits at the block boundary before it.
    c = pool.allocate(3)
    assert cache.insert([1, 2, 7, 4, 0, 0], c) == 2
    assert edges(cache)[(1, 2)] == a[:1]
    assert edges(cache)[(1, 2, 7, 4, 0, 0)] == c[1:]
    assert edges(cache)[(1, 2, 3, 4)] == a[1:2]
    pool.free(c)


def test_insert_of_cached_prefix_keeps_tree_blocks() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2, 3, 4])
    dup = pool.allocate(2)
    assert cache.insert([1, 2, 3, 4], dup) == 4
    assert [pool.ref_count(x) for x in dup] == [1, 1]  # only the caller's own
    assert [pool.ref_count(x) for x in a] == [1, 1]
    pool.free(dup)
    assert cache.num_cached_blocks == 2
    got = cache.match_prefix([1, 2, 3, 4])
    assert got == a
    pool.free(got)
    # Inserting the blocks the caller got from match_prefix is a no-op too.
    got = cache.match_prefix([1, 2, 3, 4])
    assert cache.insert([1, 2, 3, 4], got) == 4
    assert [pool.ref_count(x) for x in got] == [2, 2]
    pool.free(got)


def test_insert_extends_existing_leaf() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2])
    got = cache.match_prefix([1, 2, 3, 4])
    rest = pool.allocate(1)
    assert cache.insert([1, 2, 3, 4, 5], got + rest) == 2
    assert edges(cache) == {(1, 2): a, (1, 2, 3, 4): rest}
    pool.free(got + rest)


def test_insert_uses_only_blocks_token_ids_cover() -> None:
    pool, cache = make()
    b = pool.allocate(3)
    assert cache.insert([1, 2, 3, 4], b) == 0  # third block has no tokens
    assert cache.num_cached_blocks == 2
    assert pool.ref_count(b[2]) == 1
    b2 = pool.allocate(1)
    assert cache.insert([5, 6, 7, 8], b2) == 0  # only one block given
    assert edges(cache)[(5, 6)] == b2


def test_insert_rejects_bad_blocks() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2])
    with pytest.raises(ValueError):
        cache.insert([3, 4], a)  # already cached under another prefix
    with pytest.raises(ValueError):
        cache.insert([3, 4], [pool.num_blocks - 1])  # a free block
    assert edges(cache) == {(1, 2): a}


def test_evict_respects_lru_order() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 1])
    b = cache_seq(pool, cache, [2, 2])
    c = cache_seq(pool, cache, [3, 3])
    pool.free(cache.match_prefix([1, 1]))  # a is now the most recent
    assert cache.evict(1) == 1
    assert pool.ref_count(b[0]) == 0
    assert cache.evict(1) == 1
    assert pool.ref_count(c[0]) == 0
    assert pool.ref_count(a[0]) == 1
    assert edges(cache) == {(1, 1): a}


def test_evict_trims_the_end_of_a_leaf_first() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2, 3, 4, 5, 6])
    free_before = pool.num_free
    assert cache.evict(1) == 1
    assert pool.num_free == free_before + 1
    assert edges(cache) == {(1, 2, 3, 4): a[:2]}
    got = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert got == a[:2]
    pool.free(got)


def test_evict_never_frees_blocks_a_request_holds() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2, 3, 4])
    b = cache_seq(pool, cache, [5, 6])
    held = cache.match_prefix([1, 2, 3, 4])  # a request now holds a's blocks
    assert cache.num_evictable_blocks == 1
    assert cache.evict(10) == 1  # only b
    assert pool.ref_count(b[0]) == 0
    assert [pool.ref_count(x) for x in a] == [2, 2]
    assert cache.num_cached_blocks == 2
    pool.free(held)
    assert cache.evict(10) == 2
    assert pool.num_free == pool.num_blocks


def test_evict_skips_tree_only_blocks_above_a_held_block() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2, 3, 4])
    # A request that computed [1 2 3 4 5 6] on its own blocks (it started before a was cached).
    r = pool.allocate(3)
    assert cache.insert([1, 2, 3, 4, 5, 6], r) == 4
    # a's blocks are tree-only, but r[2] below them is held by the request: nothing is evictable.
    assert [pool.ref_count(x) for x in a] == [1, 1]
    assert cache.num_evictable_blocks == 0
    assert cache.evict(3) == 0
    pool.free(r)
    assert cache.num_evictable_blocks == 3
    assert cache.evict(3) == 3
    assert pool.num_free == pool.num_blocks


def test_evict_frees_parents_that_become_leaves() -> None:
    pool, cache = make()
    cache_seq(pool, cache, [1, 2, 3, 4])
    cache_seq(pool, cache, [1, 2, 5, 6])  # root → (1 2) → {(3 4), (5 6)}
    assert cache.num_cached_blocks == 3
    assert cache.evict(3) == 3
    assert cache.num_cached_blocks == 0
    assert edges(cache) == {}
    assert pool.num_free == pool.num_blocks


def test_evict_stops_at_the_requested_amount() -> None:
    pool, cache = make()
    cache_seq(pool, cache, [1, 2, 3, 4, 5, 6])
    cache_seq(pool, cache, [7, 8, 9, 9])
    assert cache.evict(3) == 3
    assert cache.num_cached_blocks == 2
    assert cache.evict(0) == 0
    assert cache.num_cached_blocks == 2


def test_reset_drops_only_tree_references() -> None:
    pool, cache = make()
    a = cache_seq(pool, cache, [1, 2, 3, 4])
    b = cache_seq(pool, cache, [5, 6])
    held = cache.match_prefix([1, 2])
    cache.reset()
    assert cache.num_cached_blocks == 0
    assert cache.match_prefix([1, 2, 3, 4]) == []
    assert pool.ref_count(a[0]) == 1  # still the request's
    assert pool.ref_count(a[1]) == 0
    assert pool.ref_count(b[0]) == 0
    pool.free(held)
    assert pool.num_free == pool.num_blocks
    # The cache is usable after reset.
    c = cache_seq(pool, cache, [1, 2])
    assert edges(cache) == {(1, 2): c}


def test_many_matches_do_not_grow_the_heap_without_bound() -> None:
    pool, cache = make()
    cache_seq(pool, cache, [1, 2])
    for _ in range(1000):
        pool.free(cache.match_prefix([1, 2]))
    assert len(cache._heap) < 100
    assert cache.evict(1) == 1


def test_deep_tree_does_not_hit_recursion_limit() -> None:
    pool = BlockPool(3000)
    cache = RadixCache(pool, 1)
    # Each insert extends the previous path by one block, so the tree is 2500 nodes deep.
    tokens: list[int] = []
    held: list[int] = []
    for i in range(2500):
        tokens.append(i)
        held += pool.allocate(1)
        cache.insert(tokens, held)
    pool.free(held)
    assert cache.num_evictable_blocks == 2500
    cache.reset()
    assert pool.num_free == 3000


def test_match_counts_hits_on_the_nodes_it_reuses() -> None:
    pool, cache = make()
    cache_seq(pool, cache, [1, 2, 3, 4, 5, 6])
    pool.free(cache.match_prefix([1, 2, 3, 4, 9, 9]))  # reuses the first two blocks of the edge
    cache_seq(pool, cache, [1, 2, 3, 4, 7, 7])  # splits the edge after them
    pool.free(cache.match_prefix([1, 2, 3, 4, 7, 7, 0]))
    pool.free(cache.match_prefix([8, 8]))  # a miss touches nothing
    views = cache.top_levels(depth=2, limit=10)
    by_tokens = {view.tokens: view for view in views}
    assert by_tokens[(1, 2, 3, 4)].hits == 2  # both matches went through the shared part
    assert by_tokens[(7, 7)].hits == 1
    assert by_tokens[(5, 6)].hits == 1  # the hit before the split stays with both halves


def test_top_levels_walks_breadth_first_within_depth_and_limit() -> None:
    pool, cache = make(num_blocks=32)
    cache_seq(pool, cache, [1, 1, 2, 2, 3, 3])
    cache_seq(pool, cache, [1, 1, 2, 2, 4, 4])
    cache_seq(pool, cache, [1, 1, 5, 5])
    cache_seq(pool, cache, [6, 6])
    views = cache.top_levels(depth=2, limit=10)
    assert [(v.parent, v.depth, v.start, v.tokens) for v in views] == [
        (-1, 1, 0, (1, 1)),
        (-1, 1, 0, (6, 6)),
        (0, 2, 2, (2, 2)),
        (0, 2, 2, (5, 5)),
    ]
    assert views[2].num_children == 2  # its children lie below the depth asked for
    assert views[0].blocks == edges(cache)[(1, 1)]
    assert len(cache.top_levels(depth=3, limit=3)) == 3
    assert cache.top_levels(depth=3, limit=10)[-1].depth == 3


def test_evict_counts_the_blocks_it_frees() -> None:
    pool, cache = make()
    cache_seq(pool, cache, [1, 2, 3, 4])
    cache_seq(pool, cache, [5, 6])
    assert cache.evict(2) == 2
    assert cache.evict(5) == 1
    assert cache.num_evicted_blocks == 3


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError):
        RadixCache(BlockPool(1), 0)


# ------------------------------------------------------------------ stateful test


@dataclass
class _Request:
    tokens: tuple[int, ...]
    blocks: list[int]
    namespace: str | None


SM_BLOCK_SIZE = 2
SM_POOL = 12
tokens_st = st.lists(st.integers(0, 1), max_size=12).map(tuple)
namespaces_st = st.sampled_from([None, "tenant-b"])  # the same tokens in two namespaces never match


class SchedulerMachine(RuleBasedStateMachine):
    """Drives the cache like a scheduler would, against a tiny pool and a two-letter alphabet."""

    @initialize()
    def setup(self) -> None:
        self.pool = BlockPool(SM_POOL)
        self.cache = RadixCache(self.pool, SM_BLOCK_SIZE)
        self.requests: dict[int, _Request] = {}
        self.next_id = 0
        # content[b]: the namespace and the full token prefix whose last block block b holds, for
        # full blocks that were allocated and computed; the ground truth every match is checked
        # against.
        self.content: dict[int, tuple[str | None, tuple[int, ...]]] = {}
        self.inserted: list[tuple[int, ...]] = []

    # -- helpers

    def expected_match(self, tokens: tuple[int, ...], namespace: str | None) -> list[int]:
        """What match_prefix must return, computed from the model, not the tree's structure."""
        by_prefix = {self.content[b]: b for b in self.cache._cached}
        out: list[int] = []
        for i in range(len(tokens) // SM_BLOCK_SIZE):
            b = by_prefix.get((namespace, tokens[: (i + 1) * SM_BLOCK_SIZE]))
            if b is None:
                break
            out.append(b)
        return out

    def check_match(self, tokens: tuple[int, ...], namespace: str | None) -> list[int]:
        before = {b: self.pool.ref_count(b) for b in range(SM_POOL)}
        got = self.cache.match_prefix(tokens, namespace)
        assert got == self.expected_match(tokens, namespace)
        for b in got:
            assert self.pool.ref_count(b) == before[b] + 1
        return got

    # -- rules

    @rule(tokens=tokens_st, namespace=namespaces_st)
    def start_request(self, tokens: tuple[int, ...], namespace: str | None) -> None:
        matched = self.check_match(tokens, namespace)
        needed = -(-len(tokens) // SM_BLOCK_SIZE) - len(matched)
        if self.pool.num_free < needed:
            evictable = self.cache.num_evictable_blocks
            shortfall = needed - self.pool.num_free
            assert self.cache.evict(shortfall) == min(shortfall, evictable)
        if self.pool.num_free < needed:
            self.pool.free(matched)  # cannot schedule it: give the prefix back
            return
        fresh = self.pool.allocate(needed)
        blocks = matched + fresh
        for i in range(len(matched), len(blocks)):
            end = (i + 1) * SM_BLOCK_SIZE
            if end <= len(tokens):
                self.content[blocks[i]] = (namespace, tokens[:end])
            else:
                self.content.pop(blocks[i], None)  # partial block: never cacheable
        self.requests[self.next_id] = _Request(tokens, blocks, namespace)
        self.next_id += 1

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def insert_request(self, data: st.DataObject) -> None:
        req = self.requests[data.draw(st.sampled_from(sorted(self.requests)))]
        full = len(req.tokens) // SM_BLOCK_SIZE
        expected_cached = len(self.expected_match(req.tokens, req.namespace)) * SM_BLOCK_SIZE
        cached = self.cache.insert(req.tokens, req.blocks, req.namespace)
        assert cached == expected_cached
        self.inserted.append(req.tokens)
        # The request still holds all its blocks, so its whole full-block prefix is now cached.
        got = self.check_match(req.tokens, req.namespace)
        assert len(got) == full
        self.pool.free(got)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), insert_first=st.booleans())
    def finish_request(self, data: st.DataObject, insert_first: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        req = self.requests.pop(rid)
        if insert_first:
            self.cache.insert(req.tokens, req.blocks, req.namespace)
            self.inserted.append(req.tokens)
        self.pool.free(req.blocks)

    @rule(amount=st.integers(0, SM_POOL))
    def evict(self, amount: int) -> None:
        evictable = self.cache.num_evictable_blocks
        free_before = self.pool.num_free
        freed = self.cache.evict(amount)
        assert freed == min(amount, evictable)
        assert self.pool.num_free == free_before + freed

    @rule(data=st.data(), random_tokens=tokens_st, namespace=namespaces_st)
    def probe(self, data: st.DataObject, random_tokens: tuple[int, ...], namespace: str | None) -> None:
        tokens = random_tokens
        if self.inserted and data.draw(st.booleans()):
            tokens = data.draw(st.sampled_from(self.inserted))
        self.pool.free(self.check_match(tokens, namespace))

    @rule()
    def reset(self) -> None:
        self.cache.reset()

    # -- invariants

    @invariant()
    def refs_account_for_every_block(self) -> None:
        free = list(self.pool._free)
        assert len(free) == len(set(free))
        held_by_requests: dict[int, int] = {}
        for req in self.requests.values():
            assert len(req.blocks) == len(set(req.blocks))
            for b in req.blocks:
                held_by_requests[b] = held_by_requests.get(b, 0) + 1
        tree = self.cache._cached
        for b in range(SM_POOL):
            expected = held_by_requests.get(b, 0) + (1 if b in tree else 0)
            assert self.pool.ref_count(b) == expected, b
            assert (b in free) == (expected == 0), b
        held = set(held_by_requests) | tree
        assert self.pool.num_free + len(held) == SM_POOL
        assert self.cache.num_cached_blocks == len(tree)
        # The pool's running count of cache-only blocks (the KV metrics' "cached") agrees.
        cache_only = [b for b in tree if b not in held_by_requests]
        assert self.pool.num_cached_only == len(cache_only)
        # And so does the engine view's state of every block.
        expected_states = "".join(
            ("s" if b in held_by_requests else "c") if b in tree else ("u" if b in held_by_requests else "f")
            for b in range(SM_POOL)
        )
        assert self.pool.states() == expected_states

    @invariant()
    def tree_is_a_valid_radix_tree(self) -> None:
        bs = SM_BLOCK_SIZE
        seen: list[int] = []
        roots = self.cache._roots.values()
        assert all(root.children for root in roots), "a namespace left empty is dropped"
        stack: list[tuple[_Node, tuple[int, ...], Hashable]] = [(root, (), root.namespace) for root in roots]
        while stack:
            node, prefix, namespace = stack.pop()
            for key, child in node.children.items():
                assert child.parent is node
                assert len(child.tokens) > 0 and len(child.tokens) % bs == 0
                assert len(child.blocks) == len(child.tokens) // bs
                assert key == child.tokens[:bs]  # dict keys are distinct, so first blocks are too
                assert child.last_access <= (node.last_access if node.parent is not None else 10**18)
                path = prefix + child.tokens
                for i, b in enumerate(child.blocks):
                    # The tree's token path to this block is what the block was computed for.
                    assert self.content[b] == (namespace, path[: len(prefix) + (i + 1) * bs])
                seen.extend(child.blocks)
                stack.append((child, path, namespace))
        assert len(seen) == len(set(seen))
        assert set(seen) == self.cache._cached


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase


def test_namespaces_do_not_share_prefixes() -> None:
    pool, cache = make()
    tokens = [1, 2, 3, 4]
    blocks = pool.allocate(2)
    cache.insert(tokens, blocks, namespace=("alice", None))
    pool.free(blocks)
    assert cache.match_prefix(tokens, ("bob", None)) == []  # the same prompt, another tenant
    assert cache.match_prefix(tokens, ("alice", "salt")) == []  # the same tenant, salted
    assert cache.match_prefix(tokens) == []
    assert cache.match_prefix(tokens, ("alice", None)) == blocks
    pool.free(blocks)
    assert cache.top_levels(4, 64, ("bob", None)) == []
    assert [view.tokens for view in cache.top_levels(4, 64, ("alice", None))] == [(1, 2, 3, 4)]
    # Inserted again in another namespace, the same tokens are cached twice, on their own blocks.
    others = pool.allocate(2)
    assert cache.insert(tokens, others, namespace=("bob", None)) == 0
    pool.free(others)
    assert cache.num_cached_blocks == 4
    assert cache.evict(4) == 4 and cache._roots == {}  # emptied namespaces are forgotten
