"""Continuous batching: decide, every step, which requests compute how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running requests go first, oldest
first: a decoding request needs one token, a request still in its prompt takes as many tokens
as the budget leaves (chunked prefill). Waiting requests are then admitted in arrival order
while the budget, `max_num_seqs` and free KV blocks allow. When a running request needs a
block and none is free, the prefix cache gives back unused blocks first; after that the newest
running request is preempted: its blocks are freed and it waits to be recomputed from its
prompt plus what it has generated so far. The oldest request therefore always makes progress,
which is why this never deadlocks, and since the pool is never asked for more than it has, it
never runs out.

Pure Python on purpose: no torch here, so every policy is unit-tested in milliseconds.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from yaie.cache.block_pool import BlockPool
from yaie.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from yaie.cache.radix_cache import RadixCache


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens whose K/V this step computes, from request.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """True when this step reaches the request's last known token, so a new one is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: RadixCache | None = None,
    ) -> None:
        self.pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        # Keep a few blocks free when admitting, so that admitting a request does not force a
        # preemption on the very next decode step.
        self.watermark_blocks = max(1, block_pool.num_blocks // 100)

    # -- queue management -------------------------------------------------------------------

    def add(self, request: Request, share_prefix_of: Request | None = None) -> None:
        """Queue a request. `share_prefix_of` names a running request with the same prompt (a
        sibling of an n > 1 request): the new one takes references on its computed prompt blocks
        instead of computing them again. The last prompt token is always recomputed, so the
        request gets logits of its own to sample from."""
        request.status = RequestStatus.WAITING
        source = share_prefix_of
        if source is None or not source.block_table:
            self.waiting.append(request)
            return
        num_blocks = min(source.num_computed_tokens, request.num_tokens - 1) // self.block_size
        shared = source.block_table[:num_blocks]
        self.pool.incref(shared)
        request.block_table = list(shared)
        request.num_computed_tokens = num_blocks * self.block_size
        # A waiting request that holds blocks must not queue behind one that cannot be admitted
        # until those very blocks are freed. It arrived with its group anyway: put it first,
        # after the other block-holding requests.
        position = 0
        while position < len(self.waiting) and self.waiting[position].block_table:
            position += 1
        self.waiting.insert(position, request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the queues for good and release its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self._release_blocks(request)

    # -- the per-step decision ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self._grow(request, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            else:
                scheduled.append(ScheduledRequest(request, num_new))
                budget -= num_new
                index += 1
                continue
            break  # the request preempted itself: nobody after it is left to schedule

        # Admitting new work while evicting old work would only thrash: wait for a calmer step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if not request.block_table:
                self._match_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            reserve = self.watermark_blocks if self.running else 0
            if not self._grow(request, num_new, reserve=reserve):
                self._release_blocks(request)  # give back prefix-cache references until next time
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(ScheduledRequest(request, num_new))
            budget -= num_new
        return SchedulerOutput(scheduled, preempted)

    def update(self, output: SchedulerOutput) -> None:
        """Record that the scheduled tokens' K/V are now in the cache."""
        for item in output.scheduled:
            request = item.request
            was_in_prompt = request.num_computed_tokens < request.num_prompt_tokens
            request.num_computed_tokens += item.num_new_tokens
            # Share a finished prompt right away, so requests arriving with the same prefix
            # while this one is still generating do not compute it again.
            if was_in_prompt and request.num_computed_tokens >= request.num_prompt_tokens:
                self._cache_computed_blocks(request)

    # -- blocks -----------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, request: Request, num_new_tokens: int, reserve: int = 0) -> bool:
        """Make the request's block table cover `num_new_tokens` more tokens, if blocks allow."""
        needed = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_table)
        if needed <= 0:
            return True
        shortfall = needed + reserve - self.pool.num_free
        if shortfall > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(shortfall)
        if needed + reserve > self.pool.num_free:
            return False
        request.block_table.extend(self.pool.allocate(needed))
        return True

    def _match_prefix(self, request: Request) -> None:
        # Prompt logprobs need the logits of every prompt position, so nothing may come from cache.
        if self.prefix_cache is None or request.sampling_params.prompt_logprobs is not None:
            return
        # Leave at least the last token to compute: its logits are what we sample from.
        blocks = self.prefix_cache.match_prefix(request.all_token_ids[:-1])
        request.block_table = blocks
        request.num_computed_tokens = len(blocks) * self.block_size
        if request.num_preemptions == 0:
            request.num_cached_tokens = min(request.num_computed_tokens, request.num_prompt_tokens)

    def _cache_computed_blocks(self, request: Request) -> None:
        if self.prefix_cache is None:
            return
        full_blocks = request.num_computed_tokens // self.block_size
        if full_blocks:
            self.prefix_cache.insert(request.all_token_ids, request.block_table[:full_blocks])

    def _release_blocks(self, request: Request) -> None:
        self._cache_computed_blocks(request)
        self.pool.free(request.block_table)
        request.block_table = []
        request.num_computed_tokens = 0

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, wait at the front."""
        self._release_blocks(request)
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
