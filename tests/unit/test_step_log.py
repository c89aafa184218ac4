"""The engine view's step log, driven by a real scheduler without a model (as in test_scheduler)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from yaie.cache.block_pool import BlockPool
from yaie.cache.radix_cache import RadixCache
from yaie.engine import step_log
from yaie.engine.scheduler import Scheduler
from yaie.engine.sequence import Sequence
from yaie.engine.step_log import HISTORY_S, NUM_RECENT_STEPS, StepLog
from yaie.sampling_params import SamplingParams

BLOCK = 4


class FixedDrafter:
    """Drafts `draft` for every decoding sequence (none while it is empty)."""

    def __init__(self) -> None:
        self.draft: list[int] = []

    def propose(self, seqs: list[Sequence], room: int) -> list[list[int]]:
        return [list(self.draft) for _ in seqs]


def make_scheduler(num_blocks: int = 64, budget: int = 64) -> Scheduler:
    pool = BlockPool(num_blocks)
    return Scheduler(pool, BLOCK, 8, budget, prefix_cache=RadixCache(pool, BLOCK), drafter=FixedDrafter())


def add(scheduler: Scheduler, log: StepLog, name: str, prompt_len: int, first_token: int = 0) -> Sequence:
    seq = Sequence(f"{name}-0", list(range(first_token, first_token + prompt_len)),
                   SamplingParams(max_tokens=100), request_id=name)  # fmt: skip
    scheduler.add(seq)
    log.arrived(name)
    return seq


def step(scheduler: Scheduler, log: StepLog, draft: list[int] | None = None, kept: int = 0) -> None:
    """One engine step as Engine.step orders it, with the runner and sampler played by hand:
    each decoding sequence verifies `draft`, keeps its first `kept` tokens, then samples 7."""
    started = time.perf_counter()
    assert isinstance(scheduler.drafter, FixedDrafter)
    scheduler.drafter.draft = draft or []
    batch = scheduler.schedule()
    for item in batch.scheduled:
        if item.samples:
            for token in [*item.spec_token_ids[:kept], 7]:
                item.seq.append_token(token)
    generated = sum(item.num_appended_tokens() for item in batch.scheduled)
    scheduler.update(batch)
    log.record(batch, generated, started, scheduler)


def total(log: StepLog, field: str) -> float:
    return sum(log.to_json()["seconds"][field])


def recent_steps(log: StepLog) -> list[dict[str, float]]:
    """The recent steps, as rows (to_json gives one list per field)."""
    columns = log.to_json()["recent_steps"]
    return [dict(zip(columns, row, strict=True)) for row in zip(*columns.values(), strict=True)]


def test_records_nothing_until_watched_and_stops_when_the_lease_ends() -> None:
    log = StepLog()
    assert not log.watched
    log.arrived("early")  # not watched: forgotten
    log.watch(lease_s=60)
    assert log.watched
    log.watch(lease_s=0)  # a lease that has already run out
    assert not log.watched
    json_ready = log.to_json()
    assert not json_ready["events"]
    assert json_ready["seconds"]["steps"] == [] and json_ready["recent_steps"]["time"] == []


def test_steps_split_into_prefill_and_decode_tokens_and_time_to_first_token() -> None:
    scheduler, log = make_scheduler(budget=6), StepLog()
    log.watch()
    add(scheduler, log, "a", prompt_len=10)
    step(scheduler, log)  # a prompt chunk of 6
    step(scheduler, log)  # the last 4 prompt tokens, sampling the first token
    step(scheduler, log)  # decode: one token
    steps = recent_steps(log)
    assert [(s["prefill_tokens"], s["decode_tokens"]) for s in steps] == [(6, 0), (4, 0), (0, 1)]
    assert all(s["num_running"] == 1 and s["num_waiting"] == 0 and s["duration_s"] >= 0 for s in steps)
    assert total(log, "steps") == 3
    assert total(log, "prefill_tokens") == 10
    assert total(log, "sampled_tokens") == 2
    assert total(log, "num_ttft") == 1  # only the first token counts
    assert total(log, "ttft_sum_s") > 0
    assert total(log, "busy_s") >= max(s["duration_s"] for s in steps)


def test_a_verifying_step_counts_every_token_it_kept() -> None:
    scheduler, log = make_scheduler(), StepLog()
    log.watch()
    add(scheduler, log, "a", prompt_len=4)
    add(scheduler, log, "b", prompt_len=4, first_token=100)
    step(scheduler, log)  # the prompts, sampling a first token each
    step(scheduler, log, draft=[1, 2, 3], kept=2)  # each: 2 drafts kept, then its own token
    step(scheduler, log, draft=[1, 2, 3], kept=0)  # each: all rejected, its own token only
    assert [s["decode_tokens"] for s in recent_steps(log)] == [0, 2, 2]
    assert total(log, "sampled_tokens") == 2 + 2 * 3 + 2 * 1


def test_preemptions_and_evictions_become_events() -> None:
    # 4 blocks: two sequences of 2 blocks fill the pool, so the first one's growth preempts the other.
    scheduler, log = make_scheduler(num_blocks=5, budget=64), StepLog()
    log.watch()
    add(scheduler, log, "a", prompt_len=8)
    add(scheduler, log, "b", prompt_len=8, first_token=100)
    step(scheduler, log)
    while not total(log, "preemptions"):
        step(scheduler, log)
    [event] = [e for e in log.events if e["kind"] == "preemption"]
    assert event["request_id"] == "b" and event["index"] == 0
    # "b" was cached when preempted; growing "a" further evicts its cached blocks.
    while not total(log, "evicted_blocks"):
        step(scheduler, log)
    evictions = [e for e in log.events if e["kind"] == "eviction"]
    assert sum(e["num_blocks"] for e in evictions) == total(log, "evicted_blocks") > 0


def test_evictions_while_nobody_watched_are_not_reported() -> None:
    scheduler, log = make_scheduler(), StepLog()
    cache = scheduler.prefix_cache
    assert cache is not None
    log.watch()
    step(scheduler, log)  # the baseline of the eviction counter
    cache.num_evicted_blocks += 3  # as if evictions happened while the lease had run out...
    log.watch(lease_s=0)
    log.watch()  # ...and a page came back
    step(scheduler, log)
    assert not log.events and total(log, "evicted_blocks") == 0


def test_recent_steps_are_bounded() -> None:
    scheduler, log = make_scheduler(), StepLog()
    log.watch()
    add(scheduler, log, "a", prompt_len=4)
    for _ in range(NUM_RECENT_STEPS + 5):
        step(scheduler, log)
    assert len(recent_steps(log)) == NUM_RECENT_STEPS
    assert total(log, "steps") == NUM_RECENT_STEPS + 5


def test_each_second_gets_one_bin_and_only_the_last_ones_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = SimpleNamespace(now=1000.5)
    # The bins follow time.time(); the lease and the step durations keep the real clocks.
    fake = SimpleNamespace(time=lambda: clock.now, perf_counter=time.perf_counter, monotonic=time.monotonic)
    monkeypatch.setattr(step_log, "time", fake)
    scheduler, log = make_scheduler(), StepLog()
    log.watch()
    for second in range(HISTORY_S + 3):
        clock.now = 1000.5 + second
        step(scheduler, log)
        step(scheduler, log)
    seconds = log.to_json()["seconds"]
    assert seconds["second"] == list(range(1003, 1000 + HISTORY_S + 3))
    assert seconds["steps"] == [2] * HISTORY_S
    assert all(len(column) == HISTORY_S for column in seconds.values())
