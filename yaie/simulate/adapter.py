"""The simulator's one point of contact with the engine's scheduler, block pool and prefix cache.

These are the engine's own classes, not copies: what is simulated is the policy that runs. Kept
to this module so a change in their signatures is mended in one place.
"""

from __future__ import annotations

from dataclasses import dataclass

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache
from yaie.engine.scheduler import Scheduler, SchedulerOutput
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.sampling_params import SamplingParams


@dataclass(frozen=True)
class StepItem:
    seq: Sequence
    num_new_tokens: int
    context_len: int  # tokens of the sequence whose K/V attention reads: its context through this step
    samples: bool
    decoding: bool  # past its prompt: the one new token is the last one sampled


def step_items(output: SchedulerOutput) -> list[StepItem]:
    """What a scheduled step computes; call before `Scheduler.update`, which moves the counts on."""
    items = []
    for s in output.scheduled:
        items.append(StepItem(s.seq, s.num_new_tokens, s.context_len, s.samples, s.decoding))
    return items


class EngineScheduler:
    """A Scheduler over its own BlockPool (and RadixCache when prefix caching is on)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_caching: bool,
        long_prefill_token_threshold: int,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = RadixCache(self.pool, block_size) if prefix_caching else None
        self.scheduler = Scheduler(
            self.pool, block_size, max_num_seqs, max_num_batched_tokens, prefix_cache=self.prefix_cache,
            long_prefill_token_threshold=long_prefill_token_threshold,
        )  # fmt: skip

    def add(self, seq_id: str, prompt_token_ids: list[int]) -> Sequence:
        seq = Sequence(seq_id, prompt_token_ids, SamplingParams(max_tokens=None))
        self.scheduler.add(seq)
        return seq

    def step(self) -> list[StepItem]:
        """Schedule one step and record it as computed."""
        output = self.scheduler.schedule()
        items = step_items(output)
        self.scheduler.update(output)
        return items

    def finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)

    def blocks_needed(self, num_tokens: int) -> int:
        return self.scheduler.blocks_needed(num_tokens)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used
