"""Both scheduling policies, driven without a model (property test): requests with random
prompts, priorities and lengths arrive over time, some end early (an abort or a deadline, while
waiting or running), and every step we check what the policy promises: the waiting queue in the
policy's order, admissions from its head, preemption victims ranked after everyone left
running, the step's limits, no block held twice or leaked, and that everything finishes."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from yaie.cache.block_pool import BlockPool
from yaie.engine.scheduler import Scheduler
from yaie.engine.sequence import Sequence, SequenceStatus
from yaie.sampling_params import SamplingParams

BLOCK = 4
MAX_PROMPT = 12
MAX_TOKENS = 10


@dataclass(frozen=True)
class Arrival:
    step: int  # the step before which it is added
    prompt_len: int
    priority: int
    max_tokens: int
    ends_at: int | None  # the step before which it is ended early (abort, timeout), if still going


arrivals = st.builds(
    Arrival,
    step=st.integers(0, 15),
    prompt_len=st.integers(1, MAX_PROMPT),
    priority=st.integers(-2, 2),
    max_tokens=st.integers(1, MAX_TOKENS),
    ends_at=st.none() | st.integers(0, 40),
)


def rank(policy: str, seq: Sequence) -> tuple[int, ...]:
    """The order the policy keeps: arrival under fcfs, (priority, arrival) under priority."""
    return (seq.priority, seq.arrival) if policy == "priority" else (seq.arrival,)


@settings(max_examples=150, deadline=None)
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    requests=st.lists(arrivals, min_size=1, max_size=12),
    # One sequence alone always fits (a longest prompt plus max_tokens takes 6 blocks).
    num_blocks=st.integers(6, 16),
    budget=st.integers(1, 32),
    max_seqs=st.integers(1, 6),
)
# A more urgent latecomer needs a block when the pool is empty: the older, less urgent sequence,
# already planned earlier in the step, is the victim and is taken back out of the plan.
@example(
    policy="priority",
    requests=[Arrival(0, 8, 2, 10, None), Arrival(1, 4, 1, 10, None), Arrival(1, 7, -2, 10, 30)],
    num_blocks=6,
    budget=32,
    max_seqs=6,
)
def test_policy_invariants(
    policy: str, requests: list[Arrival], num_blocks: int, budget: int, max_seqs: int
) -> None:
    pool = BlockPool(num_blocks)
    s = Scheduler(pool, BLOCK, max_seqs, budget, policy=policy)
    seqs: list[tuple[Arrival, Sequence]] = []
    for i, arrival in enumerate(requests):
        prompt = [i % 7 + t for t in range(arrival.prompt_len)]
        params = SamplingParams(max_tokens=arrival.max_tokens)
        seqs.append((arrival, Sequence(f"r{i}", prompt, params, priority=arrival.priority)))
    step = 0
    while step <= 15 or s.has_unfinished():
        assert step < 1000, "no progress"
        for arrival, seq in seqs:
            if arrival.step == step:
                s.add(seq)
            elif arrival.ends_at == step and arrival.step < step and not seq.status.finished:
                s.finish(seq, SequenceStatus.FINISHED_TIMEOUT)
                assert seq.block_table == [] and seq not in s.running and seq not in s.waiting
        waiting_before, running_before = list(s.waiting), list(s.running)

        plan = s.schedule()

        # The step's limits.
        assert plan.num_batched_tokens <= budget and len(s.running) <= max_seqs
        assert all(item.num_new_tokens > 0 for item in plan.scheduled)
        assert {item.seq for item in plan.scheduled} <= set(s.running)
        # The waiting queue is in the policy's order, and admissions came from its head.
        keys = [rank(policy, seq) for seq in s.waiting]
        assert keys == sorted(keys)
        admitted = [seq for seq in s.running if seq not in running_before]
        if admitted:
            assert not plan.preempted  # no admissions in a step that preempts
            assert admitted == waiting_before[: len(admitted)]
        # Victims: each ranked after every sequence still running (fcfs: admitted after them).
        for victim in plan.preempted:
            assert victim.block_table == [] and victim.status is SequenceStatus.WAITING
            if policy == "priority":
                assert all(rank(policy, seq) < rank(policy, victim) for seq in s.running)
        if plan.preempted and policy == "fcfs":
            assert s.running == running_before[: len(s.running)]
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
        step += 1

    assert pool.num_free == num_blocks
    for arrival, seq in seqs:
        assert seq.status.finished
        if seq.status is SequenceStatus.FINISHED_LENGTH:
            assert seq.num_output_tokens == arrival.max_tokens
