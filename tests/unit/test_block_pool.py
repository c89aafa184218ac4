import pytest

from yaie.cache.block_pool import BlockPool, NoFreeBlocksError


def test_allocate_and_free_round_trip():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3 and pool.num_free == 1 and pool.num_used == 3
    assert all(pool.ref_count(b) == 1 for b in blocks)
    pool.free(blocks)
    assert pool.num_free == 4 and all(pool.ref_count(b) == 0 for b in blocks)


def test_shared_block_returns_only_after_last_reference():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.incref([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_free == 1 and pool.ref_count(block) == 1
    pool.free([block])
    assert pool.num_free == 2


def test_over_allocation_raises_and_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_double_free_and_sharing_a_free_block_are_errors():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed twice"):
        pool.free([block])
    with pytest.raises(ValueError, match="is free"):
        pool.incref([block])


def test_empty_pool_is_rejected():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_blocks_held_by_the_cache_alone_are_counted_apart() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(2)  # a sequence holds them
    pool.incref(blocks, by_cache=True)  # the prefix cache adopts them
    assert pool.num_cached_only == 0
    pool.free(blocks)  # the sequence finishes: only the cache holds them now
    assert (pool.num_used, pool.num_cached_only) == (2, 2)
    pool.incref(blocks[:1])  # a new sequence matches the first one
    assert pool.num_cached_only == 1
    pool.free(blocks, by_cache=True)  # eviction drops the cache's references
    assert (pool.num_used, pool.num_cached_only) == (1, 0)
    with pytest.raises(ValueError, match="not held by the prefix cache"):
        pool.free(blocks[:1], by_cache=True)
    with pytest.raises(ValueError, match="already held by the prefix cache"):
        pool.incref(blocks[:1], by_cache=True)
        pool.incref(blocks[:1], by_cache=True)


def test_states_follow_every_reference_change():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert pool.states() == "uuuf"
    pool.incref([b, c], by_cache=True)  # the cache shares b and c with their sequences
    assert pool.states() == "ussf"
    pool.free([c])  # c's sequence is done: only the cache holds it
    assert pool.states() == "uscf"
    pool.incref([c])  # a new sequence reuses the cached c
    assert pool.states() == "ussf"
    pool.free([c])
    pool.free([c], by_cache=True)  # evicted
    pool.free([a])
    assert pool.states() == "fsff"
    pool.free([b], by_cache=True)  # the cache lets go of b, its sequence still holds it
    assert pool.states() == "fuff"
