"""Continuous batching: decide, every step, which sequences compute how many tokens.

Each step has a token budget (`max_num_batched_tokens`). Running sequences go first, and of
them the decoding ones first, one token each, in admission order; then the running sequences
still in their prompt (or recomputing after a preemption) take chunks of what the budget leaves
(chunked prefill), each at most `long_prefill_token_threshold` tokens. That is Sarathi-Serve's
stall-free batching: a decode never waits for a prompt, and a long prompt never takes a whole
step, so a request that arrives while it is computed is admitted beside it instead of waiting
for its end. Waiting sequences are then admitted from the head of the waiting queue while the
budget, `max_num_seqs` and free KV blocks allow, their prompts chunked the same way. When a
running sequence needs a block and none is free, the prefix cache gives back unused blocks
first; after that a running sequence is preempted: its blocks are freed and it waits to be
recomputed from its prompt plus what it has generated so far. The running sequence the policy
ranks first therefore always makes progress, which is why this never deadlocks, and since the pool is
never asked for more than it has, it never runs out.

The scheduling policy (vLLM's `scheduling_policy`) decides the two orders:
- "fcfs": the waiting queue is in arrival order (a preempted sequence goes back to its head),
  and the victim of a preemption is the newest admitted running sequence.
- "priority": each sequence carries its request's `priority` (lower first, as vLLM): the
  waiting queue is ordered by (priority, arrival), and the victim is the running sequence with
  the largest (priority, arrival), which may be one already planned this step (it is taken back
  out of the plan). A waiting sequence of higher priority does not preempt running ones to get
  in (as vLLM): it is admitted first when room frees up.

Fair share between tenants, under either policy: each sequence carries its request's `tenant`
(who sent it: the server's API key). The scheduler counts each active tenant's service, the
tokens its sequences computed weighted PREFILL_WEIGHT a prompt token and DECODE_WEIGHT a decode
token (the Virtual Token Counter of Sheng et al., OSDI 2024), and a tenant that becomes active
starts level with the least served active one. Of the waiting sequences the policy ranks first
(all under fcfs; those of the most urgent priority under priority: priority wins), the one
admitted is the first of the tenant with the least service; so a tenant that floods the queue
is admitted in turn with the others, not ahead of them. The victim of a preemption is taken,
among the least urgent, from the tenant with the most service. With one tenant, all of this is
the policy's order above.

A request with n > 1 choices arrives as n sequences with the same prompt. Only the first is
queued; its siblings wait until it has computed the prompt and then share its KV blocks, so the
prompt is computed once, not n times.

A pooling sequence (an embedding, yaie/pooling_params.py) is scheduled like any prompt, in
chunks beside the others; the step that reaches its prompt's end `pools` instead of sampling,
and the sequence finishes there, freeing its blocks (its computed prompt blocks go to the prefix
cache like any finished prompt's). It never decodes, so it is never given drafts.

`schedule()` returns the step's plan, a frozen `SchedulerOutput`: what each sequence computes,
as of when the plan was made. With speculative decoding the scheduler's `Drafter` proposes
draft tokens for the step's decoding sequences while the plan is made, and the plan holds as
many of them as the budget and the free blocks allow. After the step, `update(plan, finished)`
records it and releases exactly the sequences the step finished; aborts and failures between
steps come through `finish`, from the engine that owns the requests.

Pure Python on purpose: no torch here, so every policy is unit-tested in milliseconds.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from yaie.cache.block_pool import BlockPool
from yaie.config import SCHEDULING_POLICIES
from yaie.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from yaie.cache.radix_cache import RadixCache

# The Virtual Token Counter's weights (Sheng et al., "Fairness in Serving Large Language Models",
# OSDI 2024): the service a tenant is counted for each token a step computes for it. The paper's
# 1 and 2, as providers' prices weigh input and output tokens: a decode token is computed alone,
# a prompt token in a chunk that shares one pass over the weights.
PREFILL_WEIGHT = 1
DECODE_WEIGHT = 2


class Drafter(Protocol):
    """Where a plan's draft tokens come from (speculative decoding, yaie/spec/decoder.py)."""

    def propose(self, seqs: list[Sequence], room: int) -> list[list[int]]:
        """Draft tokens to verify after each of `seqs` (the step's decoding sequences, in batch
        order), at most `room` in all: per sequence, a list (empty: no draft)."""
        ...


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's part of a step, fixed when the step is planned."""

    seq: Sequence
    num_new_tokens: int  # tokens whose K/V this step computes, from num_computed_tokens on
    # Speculative decoding: draft tokens scheduled after the sequence's last token, counted in
    # num_new_tokens, whose K/V is kept only as far as the target agrees with them.
    spec_token_ids: tuple[int, ...] = ()
    # Tokens of the sequence whose K/V was in the cache when the step was planned.
    num_computed_tokens: int = field(init=False)
    # Whether this step reaches the sequence's last known token, so a new one is sampled.
    samples: bool = field(init=False)
    # A pooling sequence's counterpart: the step reaches the prompt's end, so its vector is made.
    pools: bool = field(init=False)
    # Past its prompt: the step computes the last sampled token (and any drafts after it).
    decoding: bool = field(init=False)

    def __post_init__(self) -> None:
        seq, done = self.seq, self.seq.num_computed_tokens
        object.__setattr__(self, "num_computed_tokens", done)
        reaches_end = done + self.num_new_tokens - len(self.spec_token_ids) == seq.num_tokens
        pooling = seq.pooling_params is not None
        object.__setattr__(self, "samples", reaches_end and not pooling)
        object.__setattr__(self, "pools", reaches_end and pooling)
        object.__setattr__(self, "decoding", done >= seq.num_prompt_tokens)

    @property
    def context_len(self) -> int:
        """Tokens of the sequence whose K/V attention reads: its context through this step."""
        return self.num_computed_tokens + self.num_new_tokens

    def num_kept_spec_tokens(self) -> int:
        """How many draft tokens became the sequence's own tokens, in order, once the step's
        tokens were appended (their K/V, computed from the same tokens, is valid)."""
        first = self.context_len - len(self.spec_token_ids)
        kept = 0
        for draft, actual in zip(self.spec_token_ids, self.seq.all_token_ids[first:], strict=False):
            if draft != actual:
                break
            kept += 1
        return kept

    def num_appended_tokens(self) -> int:
        """Tokens the step appended to the sequence, read once they are: its sampled one and
        the drafts it kept (fewer where a stop ended the run), until its next step appends more."""
        return self.seq.num_tokens - self.context_len + len(self.spec_token_ids) if self.samples else 0


@dataclass(frozen=True)
class SchedulerOutput:
    """The plan of one step: who computes how many tokens, and who was preempted to make room."""

    scheduled: tuple[ScheduledSequence, ...]
    preempted: tuple[Sequence, ...] = ()

    def __post_init__(self) -> None:  # lists are welcome; the plan keeps tuples
        object.__setattr__(self, "scheduled", tuple(self.scheduled))
        object.__setattr__(self, "preempted", tuple(self.preempted))

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def sampling_seqs(self) -> list[Sequence]:
        """The sequences that sample a token this step: one logits row each (1 + k with k
        drafts), in this order."""
        return [s.seq for s in self.scheduled if s.samples]

    @property
    def has_drafts(self) -> bool:
        return any(s.spec_token_ids for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        block_pool: BlockPool,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefix_cache: RadixCache | None = None,
        drafter: Drafter | None = None,
        policy: str = "fcfs",
        long_prefill_token_threshold: int = 0,
    ) -> None:
        """`drafter`: with speculative decoding, what drafts the tokens each plan verifies.
        `policy`: one of SCHEDULING_POLICIES (see the module docstring).
        `long_prefill_token_threshold`: the most prompt tokens one sequence computes in a step
        (0: as many as the budget leaves)."""
        if policy not in SCHEDULING_POLICIES:
            choices = ", ".join(SCHEDULING_POLICIES)
            raise ValueError(f"scheduling policy must be one of {choices}; got {policy!r}")
        self.policy = policy
        self.pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.prefix_cache = prefix_cache
        self.drafter = drafter
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order
        self._arrivals = itertools.count()
        self.num_preemptions = 0
        self.num_computed_prompt_tokens = 0  # prompt tokens run through the model (not cache hits)
        # n > 1: siblings waiting for the first choice's prompt (see `add`), by that choice.
        self._siblings: dict[Sequence, list[Sequence]] = {}
        # Fair share: the service (weighted tokens computed) counted to each active tenant, one
        # with a sequence here (waiting, running or a waiting sibling), and how many it has.
        self._service: dict[str, int] = {}
        self._num_seqs: dict[str, int] = {}
        # Keep a few blocks free when admitting, so that admitting a sequence does not force a
        # preemption on the very next decode step.
        self.watermark_blocks = max(1, block_pool.num_blocks // 100)

    # -- queue management -------------------------------------------------------------------

    def add(self, seq: Sequence, siblings: Iterable[Sequence] = ()) -> None:
        """Queue a sequence. `siblings`, the other choices of the same request (same prompt),
        wait until `seq` has computed the prompt, then take references on its prompt blocks
        instead of computing them again."""
        siblings = list(siblings)
        seq.status = SequenceStatus.WAITING
        seq.arrival = next(self._arrivals)
        tenant = seq.tenant
        if tenant not in self._num_seqs:
            # A tenant that becomes active starts level with the least served of the others
            # (VTC's lift): counting from where it stopped would let an idle tenant bank credit,
            # and from zero would let it take the engine until it caught up.
            self._service[tenant] = min(self._service.values(), default=0)
            self._num_seqs[tenant] = 0
        self._num_seqs[tenant] += 1 + len(siblings)
        self._enqueue(seq, len(self.waiting))
        if siblings:
            for sibling in siblings:
                sibling.arrival = seq.arrival  # one request: one place in the order
            self._siblings[seq] = siblings

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self, tenant: str | None = None) -> int:
        """Sequences waiting for admission (siblings waiting for their first choice's prompt
        included): all of them, or `tenant`'s."""
        waiting = itertools.chain(self.waiting, *self._siblings.values())
        if tenant is None:
            return sum(1 for _ in waiting)
        return sum(1 for seq in waiting if seq.tenant == tenant)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take a sequence out of the queues for good and release its blocks: one the step
        finished (through `update`), or one of a request the engine aborts or fails."""
        if seq.status.finished:
            return  # released already
        self._num_seqs[seq.tenant] -= 1
        if not self._num_seqs[seq.tenant]:  # no longer active: it starts level when it comes back
            del self._num_seqs[seq.tenant], self._service[seq.tenant]
        self._release_siblings(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        else:  # a sibling still waiting for its source's prompt
            for siblings in self._siblings.values():
                if seq in siblings:
                    siblings.remove(seq)
        seq.status = status
        self._release_blocks(seq)

    # -- the per-step decision ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: who computes how many tokens (and, when speculating, which
        drafts follow each decoding sequence's last token)."""
        budget = self.max_num_batched_tokens
        planned: dict[Sequence, int] = {}  # in batch order
        preempted: list[Sequence] = []

        # Stall-free batching (Sarathi-Serve): every decode first, one token each, then prompt
        # chunks from what is left, so that no prompt, however long or old, holds up a decode.
        decoding = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens == 1]
        prefilling = [seq for seq in self.running if seq.num_tokens - seq.num_computed_tokens > 1]
        for seq in decoding + prefilling:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(seq, budget)
            while not self._grow(seq, num_new):
                victim = self._victim()
                self.running.remove(victim)
                if victim in planned:  # planned earlier in this step: take its part back
                    budget += planned[victim]
                    self._charge(victim, -planned.pop(victim))
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            else:
                planned[seq] = num_new
                budget -= num_new
                self._charge(seq, num_new)

        # Admitting new work while evicting old work would only thrash: wait for a calmer step.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self._next_admission()
            if not seq.block_table:
                self._match_prefix(seq)
            num_new = self._chunk(seq, budget)
            reserve = self.watermark_blocks if self.running else 0
            if not self._grow(seq, num_new, reserve=reserve):
                # Nobody else goes first: the one the policy chose gets in when room frees up.
                self._release_blocks(seq)  # give back prefix-cache references until next time
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            planned[seq] = num_new
            budget -= num_new
            self._charge(seq, num_new)

        drafts = self._lookahead(planned, budget) if self.drafter is not None else {}
        scheduled = []
        for seq, num_new in planned.items():
            draft = drafts.get(seq, ())
            scheduled.append(ScheduledSequence(seq, num_new + len(draft), draft))
        return SchedulerOutput(tuple(scheduled), tuple(preempted))

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The tokens `seq` computes this step, out of the `budget` left: all it lacks, but at
        most `long_prefill_token_threshold` of a prompt, so that a long prompt leaves room in
        every step for other prompts beside it (vLLM's option)."""
        num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if 0 < self.long_prefill_token_threshold < num_new:
            return self.long_prefill_token_threshold
        return num_new

    def _lookahead(self, planned: dict[Sequence, int], room: int) -> dict[Sequence, tuple[int, ...]]:
        """Draft tokens after the decoding sequences' last tokens, for the target to verify in
        this step: they count against the step's token budget (`room` is what it has left),
        and their slots need blocks, taken only where free (speculation never preempts or
        evicts), so a sequence may keep only a prefix of its draft, or none."""
        assert self.drafter is not None
        decoding = [
            seq
            for seq, num_new in planned.items()
            if num_new == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and seq.pooling_params is None
        ]
        if not decoding or room <= 0:
            return {}
        lookahead: dict[Sequence, tuple[int, ...]] = {}
        for seq, draft in zip(decoding, self.drafter.propose(decoding, room), strict=True):
            draft = draft[: max(0, room)]
            while draft and not self._grow(seq, 1 + len(draft), evict=False):
                draft = draft[: len(draft) - 1]
            if draft:
                lookahead[seq] = tuple(draft)
                room -= len(draft)
                self._charge(seq, len(draft))
        return lookahead

    def update(
        self, plan: SchedulerOutput, finished: Mapping[Sequence, SequenceStatus] | None = None
    ) -> None:
        """After the step: record that the planned tokens' K/V are now in the cache, hand
        finished prompts to the prefix cache and to waiting siblings, and release exactly the
        sequences the step `finished` (the output processor's stops, and the sequences of a
        request that failed while its output was made). Draft tokens the target did not keep
        are rolled back: their slots are overwritten later, and blocks taken only for them go
        back to the pool."""
        for item in plan.scheduled:
            seq = item.seq
            prompt_left = seq.num_prompt_tokens - item.num_computed_tokens
            self.num_computed_prompt_tokens += max(0, min(prompt_left, item.num_new_tokens))
            rejected = len(item.spec_token_ids) - item.num_kept_spec_tokens() if item.spec_token_ids else 0
            seq.num_computed_tokens = item.context_len - rejected
            if rejected:
                keep = self.blocks_needed(seq.num_computed_tokens)
                self.pool.free(seq.block_table[keep:])
                del seq.block_table[keep:]
            # Share a finished prompt right away, so sequences arriving with the same prefix
            # while this one is still generating do not compute it again.
            if prompt_left > 0 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                self._cache_computed_blocks(seq)
                self._release_siblings(seq)
        for seq, status in (finished or {}).items():
            self.finish(seq, status)

    def _release_siblings(self, source: Sequence) -> None:
        """Queue the siblings waiting for `source`'s prompt, sharing its computed blocks. The
        last prompt token is always recomputed, so each gets logits of its own to sample from."""
        for seq in self._siblings.pop(source, []):
            seq.status = SequenceStatus.WAITING
            num_blocks = min(source.num_computed_tokens, seq.num_tokens - 1) // self.block_size
            if num_blocks == 0:
                self._enqueue(seq, len(self.waiting))
                continue
            shared = source.block_table[:num_blocks]
            self.pool.incref(shared)
            seq.block_table = list(shared)
            seq.num_computed_tokens = num_blocks * self.block_size
            # A waiting sequence that holds blocks must not queue behind one that cannot be
            # admitted until those very blocks are freed: put it first, after the other
            # block-holding sequences (under either policy).
            position = 0
            while position < len(self.waiting) and self.waiting[position].block_table:
                position += 1
            self._enqueue(seq, position)

    # -- blocks -----------------------------------------------------------------------------

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_new_tokens: int, reserve: int = 0, evict: bool = True) -> bool:
        """Make the sequence's block table cover `num_new_tokens` more tokens, if blocks allow
        (evicting prefix-cache blocks if need be, when `evict`)."""
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        shortfall = needed + reserve - self.pool.num_free
        if shortfall > 0 and evict and self.prefix_cache is not None:
            self.prefix_cache.evict(shortfall)
        if needed + reserve > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def _match_prefix(self, seq: Sequence) -> None:
        # Prompt logprobs and mean pooling need every prompt position computed: none from cache.
        if self.prefix_cache is None or seq.needs_every_prompt_position:
            return
        # Leave at least the last token to compute: its logits (or a pooling sequence's last
        # hidden state) are what the step is for.
        blocks = self.prefix_cache.match_prefix(seq.all_token_ids[:-1], seq.cache_namespace)
        seq.block_table = blocks
        seq.num_computed_tokens = len(blocks) * self.block_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _cache_computed_blocks(self, seq: Sequence) -> None:
        if self.prefix_cache is None:
            return
        full_blocks = seq.num_computed_tokens // self.block_size
        if full_blocks:
            self.prefix_cache.insert(seq.all_token_ids, seq.block_table[:full_blocks], seq.cache_namespace)

    def _release_blocks(self, seq: Sequence) -> None:
        self._cache_computed_blocks(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _preempt(self, seq: Sequence) -> None:
        """Recompute-style preemption: drop the KV, keep the tokens, wait at the front."""
        self._release_blocks(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq, 0)

    # -- the policy's orders ----------------------------------------------------------------------

    def _enqueue(self, seq: Sequence, fcfs_position: int) -> None:
        """Put a sequence in the waiting queue: at `fcfs_position` under fcfs (the end for an
        arrival, the head for a preempted sequence); under priority, in (priority, arrival)
        order, behind the sequences holding blocks (released siblings, see above)."""
        position = fcfs_position
        if self.policy == "priority":
            position = bisect.bisect_right(self.waiting, _waiting_key(seq), key=_waiting_key)
        self.waiting.insert(position, seq)

    def _charge(self, seq: Sequence, num_tokens: int) -> None:
        """Count `num_tokens` (negative: taken back out of the plan) that the step computes for
        `seq` to its tenant's service: prompt chunks (recomputation after a preemption too) at
        PREFILL_WEIGHT a token, a decode's token and its drafts at DECODE_WEIGHT."""
        done = seq.num_computed_tokens
        decoding = done >= seq.num_prompt_tokens and done + 1 >= seq.num_tokens
        self._service[seq.tenant] += num_tokens * (DECODE_WEIGHT if decoding else PREFILL_WEIGHT)

    def _next_admission(self) -> Sequence:
        """The waiting sequence to admit next (the queue must not be empty).

        A sequence holding blocks goes first (a released sibling: see `_release_siblings`).
        Otherwise fair share (VTC): of the sequences the policy ranks first (under priority, those
        of the most urgent priority waiting; under fcfs, all), the first in the queue of the
        tenant with the least service. With one tenant this is the head of the queue."""
        head = self.waiting[0]
        if head.block_table:
            return head
        chosen = head
        seen = {head.tenant}
        for seq in itertools.islice(self.waiting, 1, None):
            if len(seen) == len(self._service) or (
                self.policy == "priority" and seq.priority != head.priority
            ):
                break  # every active tenant's first is seen, or the most urgent priority is
            if seq.tenant in seen:
                continue
            seen.add(seq.tenant)
            if self._service[seq.tenant] < self._service[chosen.tenant]:
                chosen = seq
        return chosen

    def _victim(self) -> Sequence:
        """The running sequence to preempt when blocks run out: under priority, one of the
        least urgent priority running; of those, one of the tenant with the most service
        (fair share); of its, the newest admitted. The running sequence first in the policy's
        order (the oldest admitted under fcfs, the least (priority, arrival) under priority)
        is never the victim while another runs, so it always progresses: no livelock."""
        first = self.running[0]
        if self.policy == "priority":
            first = min(self.running, key=lambda seq: (seq.priority, seq.arrival))
        candidates = [seq for seq in self.running if seq is not first] or [first]

        def rank(position: int) -> tuple[int, ...]:
            seq = candidates[position]
            if self.policy == "priority":  # ties in service: the newest arrival, as vLLM
                return (seq.priority, self._service[seq.tenant], seq.arrival, position)
            return (self._service[seq.tenant], position)

        return candidates[max(range(len(candidates)), key=rank)]


def _waiting_key(seq: Sequence) -> tuple[bool, int, int]:
    """The priority policy's waiting order: block holders first, then (priority, arrival)."""
    return (not seq.block_table, seq.priority, seq.arrival)
