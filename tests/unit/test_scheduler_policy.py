"""Both scheduling policies with fair share between tenants, driven without a model (property
test): requests from a few tenants, with random prompts, priorities and lengths, arrive over
time, some end early (an abort or a deadline, while waiting or running), and every step we
check what the policy promises: the waiting queue in the policy's order; each admission the
first waiting sequence of the least-served tenant among the most urgent (a reference Virtual
Token Counter kept here, from the plans alone, says who that is); priority before fair share;
preemption victims the least urgent, never the sequence that must progress; the step's limits;
no block held twice or leaked; and that every tenant's requests finish (none starves)."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from yaie.cache.block_pool import BlockPool
from yaie.engine.scheduler import DECODE_WEIGHT, PREFILL_WEIGHT, Scheduler, SchedulerOutput
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.sampling_params import SamplingParams

BLOCK = 4
MAX_PROMPT = 12
MAX_TOKENS = 10
TENANTS = ("a", "b", "c")


@dataclass(frozen=True)
class Arrival:
    step: int  # the step before which it is added
    prompt_len: int
    priority: int
    max_tokens: int
    ends_at: int | None  # the step before which it is ended early (abort, timeout), if still going
    tenant: str


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 15),
    prompt_len=st.integers(1, MAX_PROMPT),
    priority=st.integers(-2, 2),
    max_tokens=st.integers(1, MAX_TOKENS),
    ends_at=st.none() | st.integers(0, 40),
    tenant=st.sampled_from(TENANTS),
)


def rank(policy: str, seq: Sequence) -> tuple[int, ...]:
    """The queue's order: arrival under fcfs, (priority, arrival) under priority."""
    return (seq.priority, seq.arrival) if policy == "priority" else (seq.arrival,)


class ReferenceCounter:
    """The Virtual Token Counter as the scheduler documents it, kept from the outside: a tenant's
    service is the weighted tokens its sequences were planned; one that becomes active starts
    level with the least served active tenant; one with no sequence left is forgotten."""

    def __init__(self) -> None:
        self.service: dict[str, int] = {}
        self.num_seqs: dict[str, int] = {}

    def added(self, tenant: str) -> None:
        if tenant not in self.num_seqs:
            self.service[tenant] = min(self.service.values(), default=0)
            self.num_seqs[tenant] = 0
        self.num_seqs[tenant] += 1

    def finished(self, tenant: str) -> None:
        self.num_seqs[tenant] -= 1
        if not self.num_seqs[tenant]:
            del self.num_seqs[tenant], self.service[tenant]

    def charge(self, seq: Sequence, num_new: int, decoding: bool) -> None:
        self.service[seq.tenant] += num_new * (DECODE_WEIGHT if decoding else PREFILL_WEIGHT)


def check_admissions(
    policy: str, plan: SchedulerOutput, waiting_before: list[Sequence], running_before: list[Sequence],
    counter: ReferenceCounter,
) -> None:  # fmt: skip
    """Replay the plan against the reference counter: the running sequences' parts first, then
    each admission, which must be the least-served tenant's first of the most urgent waiting."""
    admitted = [item for item in plan.scheduled if item.seq not in running_before]
    for item in plan.scheduled:
        if item.seq in running_before:
            decoding = item.decoding and item.samples and item.num_new_tokens == 1
            counter.charge(item.seq, item.num_new_tokens, decoding)
    waiting = list(waiting_before)
    for item in admitted:
        urgent = min(seq.priority for seq in waiting) if policy == "priority" else None
        candidates = [seq for seq in waiting if urgent is None or seq.priority == urgent]
        assert item.seq in candidates, "priority first: a less urgent sequence was admitted"
        least = min(counter.service[seq.tenant] for seq in candidates)
        assert counter.service[item.seq.tenant] == least, "admitted a tenant that was not the least served"
        firsts = [seq for seq in candidates if seq.tenant == item.seq.tenant]
        assert item.seq is firsts[0], "a tenant's sequences are admitted in the policy's order"
        tied = [seq for seq in candidates if counter.service[seq.tenant] == least]
        assert item.seq is tied[0], "ties go to the sequence first in the queue"
        waiting.remove(item.seq)
        counter.charge(item.seq, item.num_new_tokens, False)


@settings(max_examples=200, deadline=None)
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    requests=st.lists(arrivals, min_size=1, max_size=14),
    # One sequence alone always fits (a longest prompt plus max_tokens takes 6 blocks).
    num_blocks=st.integers(6, 16),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 6),
    threshold=st.sampled_from([0, 3]),
)
# A more urgent latecomer needs a block when the pool is empty: the older, less urgent sequence,
# already planned earlier in the step, is the victim and is taken back out of the plan.
@example(
    policy="priority",
    requests=[
        Arrival(0, 8, 2, 10, None, "a"), Arrival(1, 4, 1, 10, None, "a"), Arrival(1, 7, -2, 10, 30, "a")
    ],
    num_blocks=6,
    budget=32,
    max_seqs=6,
    threshold=0,
)  # fmt: skip
# A flood from one tenant ahead of a single request from another: the other's is admitted second.
@example(
    policy="fcfs",
    requests=[Arrival(0, 4, 0, 10, None, "a")] * 6 + [Arrival(0, 4, 0, 3, None, "b")],
    num_blocks=16,
    budget=32,
    max_seqs=2,
    threshold=0,
)
def test_policy_invariants(
    policy: str, requests: list[Arrival], num_blocks: int, budget: int, max_seqs: int, threshold: int
) -> None:
    pool = BlockPool(num_blocks)
    s = Scheduler(pool, BLOCK, max_seqs, budget, policy=policy, long_prefill_token_threshold=threshold)
    counter = ReferenceCounter()
    seqs: list[tuple[Arrival, Sequence]] = []
    for i, arrival in enumerate(requests):
        prompt = [i % 7 + t for t in range(arrival.prompt_len)]
        params = SamplingParams(max_tokens=arrival.max_tokens)
        seqs.append(
            (arrival, Sequence(f"r{i}", prompt, params, priority=arrival.priority, tenant=arrival.tenant))
        )
    step = 0
    while step <= 15 or s.has_unfinished():
        assert step < 1000, "no progress"
        for arrival, seq in seqs:
            if arrival.step == step:
                s.add(seq)
                counter.added(seq.tenant)
            elif arrival.ends_at == step and arrival.step < step and not seq.status.finished:
                s.finish(seq, SequenceStatus.FINISHED_TIMEOUT)
                counter.finished(seq.tenant)
                assert seq.block_table == [] and seq not in s.running and seq not in s.waiting
        waiting_before, running_before = list(s.waiting), list(s.running)
        assert s.num_waiting() == len(waiting_before)
        assert sum(s.num_waiting(tenant) for tenant in TENANTS) == len(waiting_before)

        plan = s.schedule()

        # The step's limits.
        assert plan.num_batched_tokens <= budget and len(s.running) <= max_seqs
        assert all(item.num_new_tokens > 0 for item in plan.scheduled)
        assert {item.seq for item in plan.scheduled} <= set(s.running)
        if threshold:
            assert all(item.num_new_tokens <= threshold for item in plan.scheduled)
        # Of the running sequences, those that lack one token (decodes) come first in the batch.
        lacking_one = [
            item.samples and item.num_new_tokens == 1 for item in plan.scheduled if item.seq in running_before
        ]
        assert lacking_one == sorted(lacking_one, reverse=True)
        # The waiting queue is in the policy's order (under fcfs, each tenant's part of it: a
        # preempted sequence goes back to the head, and the tenants are admitted in turns);
        # admissions follow fair share.
        for tenant in TENANTS if policy == "fcfs" else (None,):
            keys = [rank(policy, seq) for seq in s.waiting if tenant in (None, seq.tenant)]
            assert keys == sorted(keys)
        if any(seq not in running_before for seq in s.running):
            assert not plan.preempted  # no admissions in a step that preempts
        check_admissions(policy, plan, waiting_before, running_before, counter)
        # Victims: the least urgent; the newest of their tenant (and priority); and never the
        # sequence the policy ranks first while another runs, so that one always progresses.
        first = running_before[0] if running_before else None  # fcfs: the oldest admitted
        if policy == "priority":
            first = min(running_before, key=lambda seq: rank(policy, seq), default=None)
        for victim in plan.preempted:
            assert victim.block_table == [] and victim.status is SequenceStatus.WAITING
            peers = [seq for seq in s.running if seq.tenant == victim.tenant]
            if policy == "priority":
                assert all(seq.priority <= victim.priority for seq in s.running)
                peers = [seq for seq in peers if seq.priority == victim.priority]
                assert all(seq.arrival < victim.arrival for seq in peers)
            else:
                assert all(running_before.index(seq) < running_before.index(victim) for seq in peers)
        if first in plan.preempted:
            assert not s.running, "the first-ranked sequence was preempted while others ran"
        # Every block is held by exactly one sequence; waiting sequences hold none.
        held = [block for seq in s.running for block in seq.block_table]
        assert len(held) == len(set(held)) == pool.num_used
        assert all(not seq.block_table for seq in s.waiting)
        for item in plan.scheduled:
            needed = s.blocks_needed(item.num_computed_tokens + item.num_new_tokens)
            assert len(item.seq.block_table) >= needed

        # The forward: each sampling sequence gets a token; max_tokens ends it.
        finished = {}
        s.update(plan)
        for seq in plan.sampling_seqs:
            seq.append_token(seq.num_tokens % 11)
            if seq.num_output_tokens >= (seq.sampling_params.max_tokens or 0):
                finished[seq] = SequenceStatus.FINISHED_LENGTH
        for seq, status in finished.items():
            s.finish(seq, status)
            counter.finished(seq.tenant)
        step += 1

    assert pool.num_free == num_blocks
    for arrival, seq in seqs:  # no tenant starves: everyone's requests end
        assert seq.status.finished
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == arrival.max_tokens
