"""What the engine did over the last minutes, recorded only while someone is watching.

The engine view (yaie/server/web.py) charts throughput, time to first token and step times, and
lists preemptions and evictions as they happen. Recording that costs a little on every step, so
the log records only while it is watched: each snapshot a page takes calls `watch()`, which
extends a short lease. Once the last page closes the lease runs out, and a step costs one clock
read more than it would without the log.

Steps are summed into one bin per wall-clock second (what the charts plot), and the last few
steps are kept as they were (what the batch looked like). Everything is bounded. Both are kept as
columns, one list per field, which is also how `to_json` gives them: a snapshot then copies a few
lists rather than building a dict per row, and its JSON repeats no keys (fewer bytes to write,
send and parse, four times a second, for every open page).

Pure Python: no torch, like the scheduler it reads.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, fields
from typing import Any

from yaie.engine.scheduler import Scheduler, SchedulerOutput

WATCH_LEASE_S = 5.0  # a page asks a few times a second; this outlasts a slow one
HISTORY_S = 120  # per-second bins kept: the charts' two minutes (CHART_SECONDS in engine.js)
NUM_RECENT_STEPS = 100
NUM_EVENTS = 100
# Arrival times of requests that have not produced a token yet. Aborted requests never pop
# theirs, so the oldest are dropped past this many.
NUM_ARRIVALS = 4096
# Times (in seconds) are kept to the microsecond: finer than any chart draws, and a float's JSON
# then has at most six digits after the point, not seventeen.
DECIMALS = 6


@dataclass
class SecondBin:
    """The steps that ended within one wall-clock second."""

    second: int  # Unix time, whole seconds
    steps: int = 0
    busy_s: float = 0.0  # the steps' durations, summed
    max_step_s: float = 0.0
    prefill_tokens: int = 0  # tokens computed in chunks of more than one (prompts, recomputation)
    sampled_tokens: int = 0  # tokens generated
    ttft_sum_s: float = 0.0  # arrival to first token, summed over the requests whose came here
    num_ttft: int = 0
    preemptions: int = 0
    evicted_blocks: int = 0


@dataclass(frozen=True)
class StepRecord:
    time: float  # Unix time the step ended
    duration_s: float
    prefill_tokens: int
    decode_tokens: int  # sequences that computed one token to sample the next
    num_running: int  # after the step
    num_waiting: int


class Columns:
    """Rows of one dataclass, the newest `maxlen` of them, kept as one bounded list per field."""

    def __init__(self, row_type: type[Any], maxlen: int) -> None:
        self.names = [field.name for field in fields(row_type)]
        self._columns: list[deque[Any]] = [deque(maxlen=maxlen) for _ in self.names]

    def __len__(self) -> int:
        return len(self._columns[0])

    def append(self, row: Any) -> None:
        for name, column in zip(self.names, self._columns, strict=True):
            column.append(_compact(getattr(row, name)))

    def to_json(self, *more: Any) -> dict[str, list[Any]]:
        """{field: its values, oldest row first}, followed by those of the rows `more`, which
        are not kept (a row still being filled in)."""
        json_ready = {name: list(column) for name, column in zip(self.names, self._columns, strict=True)}
        for row in more:
            for name in self.names:
                json_ready[name].append(_compact(getattr(row, name)))
        return json_ready


def _compact(value: Any) -> Any:
    return round(value, DECIMALS) if isinstance(value, float) else value


class StepLog:
    def __init__(self) -> None:
        self._watched_until = 0.0  # time.monotonic() deadline of the lease
        # Bins of seconds that have ended; the current second's bin is still being added to.
        self._past_seconds = Columns(SecondBin, HISTORY_S - 1)
        self._second: SecondBin | None = None
        self.recent_steps = Columns(StepRecord, NUM_RECENT_STEPS)
        self.events: deque[dict[str, Any]] = deque(maxlen=NUM_EVENTS)
        self._arrivals: OrderedDict[str, float] = OrderedDict()  # request id -> perf_counter()
        self._num_evicted: int | None = None  # the prefix cache's counter at the last record

    @property
    def watched(self) -> bool:
        return time.monotonic() < self._watched_until

    def watch(self, lease_s: float = WATCH_LEASE_S) -> None:
        """Record the steps of the next `lease_s` seconds (a page is looking)."""
        if not self.watched:
            self._num_evicted = None  # evictions while nobody watched are not this log's events
        self._watched_until = time.monotonic() + lease_s

    def arrived(self, request_id: str) -> None:
        """A request was added now; its first token will give its time to first token."""
        if not self.watched:
            return
        self._arrivals[request_id] = time.perf_counter()
        if len(self._arrivals) > NUM_ARRIVALS:
            self._arrivals.popitem(last=False)

    def record(
        self, batch: SchedulerOutput, num_generated: int, started: float, scheduler: Scheduler
    ) -> None:
        """One finished step: `batch` was its schedule, `num_generated` the tokens it appended
        (with speculative decoding, a sequence may get several), `started` its
        time.perf_counter() start. Call it after the new tokens were appended, and after
        `scheduler.update`."""
        ended = time.perf_counter()
        duration = ended - started
        now = time.time()
        # A decoding sequence computes its last token, and any draft tokens scheduled after it.
        decoding = [
            item
            for item in batch.scheduled
            if item.samples and item.num_new_tokens == 1 + len(item.spec_token_ids)
        ]
        decode = len(decoding)
        prefill = batch.num_batched_tokens - sum(item.num_new_tokens for item in decoding)
        bin_ = self._bin(int(now))
        bin_.steps += 1
        bin_.busy_s += duration
        bin_.max_step_s = max(bin_.max_step_s, duration)
        bin_.prefill_tokens += prefill
        bin_.sampled_tokens += num_generated
        for seq in batch.sampling_seqs:
            arrival = self._arrivals.pop(seq.request_id, None) if seq.num_output_tokens == 1 else None
            if arrival is not None:  # the first of the request's choices to produce a token
                bin_.ttft_sum_s += ended - arrival
                bin_.num_ttft += 1
        for seq in batch.preempted:
            bin_.preemptions += 1
            self.events.append(
                {"time": now, "kind": "preemption", "request_id": seq.request_id, "index": seq.index,
                 "num_tokens": seq.num_tokens, "tenant": seq.tenant}
            )  # fmt: skip
        self._record_evictions(scheduler, bin_, now)
        self.recent_steps.append(
            StepRecord(now, duration, prefill, decode, len(scheduler.running), len(scheduler.waiting))
        )

    def _record_evictions(self, scheduler: Scheduler, bin_: SecondBin, now: float) -> None:
        if scheduler.prefix_cache is None:
            return
        total = scheduler.prefix_cache.num_evicted_blocks
        evicted = 0 if self._num_evicted is None else total - self._num_evicted
        self._num_evicted = total
        if evicted:
            bin_.evicted_blocks += evicted
            self.events.append({"time": now, "kind": "eviction", "num_blocks": evicted})

    def _bin(self, second: int) -> SecondBin:
        if self._second is None or self._second.second != second:
            if self._second is not None:
                self._past_seconds.append(self._second)
            self._second = SecondBin(second)
        return self._second

    def to_json(self) -> dict[str, Any]:
        """{seconds: {field of SecondBin: [one value per bin, oldest first]}, recent_steps: {field
        of StepRecord: [one value per step]}, events: [...]}. A preemption event says whose
        sequence it was (`tenant`), for the snapshot to show each viewer only its own ids."""
        current = () if self._second is None else (self._second,)
        return {
            "seconds": self._past_seconds.to_json(*current),
            "recent_steps": self.recent_steps.to_json(),
            "events": list(self.events),
        }
