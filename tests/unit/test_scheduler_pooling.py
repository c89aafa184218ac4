"""Pooling sequences (embeddings) in the scheduler, driven without a model: chunked beside a
generating sequence, they never sample and are never drafted for, the step that reaches the
prompt's end `pools`, finishing them frees their blocks, and only last-token pooling takes a
prompt's blocks from the prefix cache."""

from __future__ import annotations

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache
from yaie.engine.scheduler import Scheduler
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams

BLOCK = 4


class AlwaysDrafts:
    """A drafter that proposes two tokens for every sequence it is asked about."""

    def __init__(self) -> None:
        self.asked: list[Sequence] = []

    def propose(self, seqs: list[Sequence], room: int) -> list[list[int]]:
        self.asked += seqs
        return [[1, 2] for _ in seqs]


def test_a_pooling_sequence_is_chunked_never_samples_and_pools_at_its_end() -> None:
    pool = BlockPool(32)
    drafter = AlwaysDrafts()
    scheduler = Scheduler(pool, BLOCK, 8, 5, drafter=drafter)
    generating = Sequence("g", [5, 6], SamplingParams(max_tokens=50))
    pooling = Sequence("p", list(range(10, 23)), PoolingParams(pooling_type="mean"))  # 13 tokens
    scheduler.add(generating)
    scheduler.add(pooling)
    pooled_at = []
    for step in range(12):
        plan = scheduler.schedule()
        finished = {}
        for item in plan.scheduled:
            if item.seq is pooling:
                assert not item.samples and not item.spec_token_ids
                if item.pools:
                    pooled_at.append(step)
                    finished[pooling] = SequenceStatus.FINISHED_STOPPED
        assert pooling not in plan.sampling_seqs
        scheduler.update(plan, finished)
        for seq in plan.sampling_seqs:
            seq.append_token(3)
        if pooling.status.finished:
            break
    assert len(pooled_at) == 1 and pooled_at[0] >= 3  # 13 tokens in chunks of at most 4 (5 - a decode)
    assert pooling not in drafter.asked and generating in drafter.asked
    assert pooling.status is SequenceStatus.FINISHED_STOPPED and pooling.block_table == []
    assert pool.num_used == len(generating.block_table)


def test_only_last_pooling_takes_cached_blocks() -> None:
    pool = BlockPool(32)
    scheduler = Scheduler(pool, BLOCK, 8, 64, prefix_cache=RadixCache(pool, BLOCK))
    prompt = list(range(10, 23))
    first = Sequence("first", prompt, PoolingParams(pooling_type="last"))
    scheduler.add(first)
    plan = scheduler.schedule()
    assert [item.pools for item in plan.scheduled] == [True]
    scheduler.update(plan, {first: SequenceStatus.FINISHED_STOPPED})  # its full blocks stay cached
    for pooling_type, computed_from_cache in (("last", 12), ("mean", 0)):
        seq = Sequence(pooling_type, prompt, PoolingParams(pooling_type=pooling_type))
        scheduler.add(seq)
        (item,) = scheduler.schedule().scheduled
        assert item.num_computed_tokens == computed_from_cache and item.pools
        scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
