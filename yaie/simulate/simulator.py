"""The simulation loop: the engine's scheduler in virtual time, with a cost model for step time.

Every step the real scheduler picks the batch; the cost model says how long it takes; the clock
moves on by that much; sequences that sampled get a token (random ids: only their count matters,
except to multi-turn prompts, which carry them into the next turn). A request reaches the engine
the cost model's `request_overhead_s` after it was sent, behind the requests sent before it (a
server's front end takes them one at a time), and joins the queue at the next step, as it would
join the engine's. Its times to first token and to the end count from when it was sent. Where the
front end shares the CPU with the engine, a step also pays the cost model's front-end time for
the requests it admits and the outputs it streams.

Scenarios change the engine, not the loop:
  * static: the classic baseline (Hugging Face `generate` over a batch): a batch of up to
    max_num_seqs waiting requests is prefilled whole and decoded until its longest member ends;
    finished members stay in the batch as padding, and no request joins until it is done;
  * continuous: iteration-level scheduling, as the engine does; `chunk=N` sets the token budget of
    a step (max_num_batched_tokens), `pool=N` the KV blocks, `prefix` turns on the radix cache;
  * spec=K@A: speculative decoding with K draft tokens per step, each accepted with probability A:
    a decoding sequence verifies K + 1 tokens per step and keeps the accepted run plus one, and a
    draft model costing `draft_cost_ratio` of the target runs K times per step.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field, replace

from yaie.config import EngineConfig
from yaie.engine.sequence import Sequence
from yaie.engine.step_shape import StepShape
from yaie.simulate.adapter import EngineScheduler, StepItem
from yaie.simulate.cost_model import CostModel
from yaie.simulate.traffic import VOCAB_SIZE, Request, Traffic


class SimulationError(ValueError):
    """Traffic the simulated engine can never serve (a request larger than the KV pool)."""


@dataclass(frozen=True)
class EngineSettings:
    num_kv_blocks: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = EngineConfig.long_prefill_token_threshold
    draft_cost_ratio: float = 0.05  # a draft model's step time over the target's, for spec=K@A


@dataclass(frozen=True)
class Scenario:
    name: str
    static: bool = False
    prefix_caching: bool = False
    max_num_batched_tokens: int | None = None  # None: the engine's
    num_kv_blocks: int | None = None
    spec_tokens: int = 0
    spec_acceptance: float = 0.0

    @classmethod
    def parse(cls, text: str) -> Scenario:
        """'static', 'continuous', or 'continuous' plus '+'-joined options: prefix, chunk=N, pool=N,
        spec=K@A; e.g. 'continuous+prefix+chunk=512'."""
        base, *options = text.strip().split("+")
        if base not in ("static", "continuous"):
            raise ValueError(f"a scenario starts with static or continuous, got {text!r}")
        scenario = cls(text.strip(), static=base == "static")
        for option in options:
            key, _, value = option.partition("=")
            try:
                if key == "prefix" and not value:
                    scenario = replace(scenario, prefix_caching=True)
                elif key == "chunk":
                    scenario = replace(scenario, max_num_batched_tokens=_positive(value))
                elif key == "pool":
                    scenario = replace(scenario, num_kv_blocks=_positive(value))
                elif key == "spec":
                    tokens, _, acceptance = value.partition("@")
                    scenario = replace(
                        scenario, spec_tokens=_positive(tokens), spec_acceptance=float(acceptance)
                    )
                    if not 0.0 <= scenario.spec_acceptance <= 1.0:
                        raise ValueError("the acceptance rate is a probability")
                else:
                    raise ValueError("unknown option")
            except ValueError as exc:
                raise ValueError(
                    f"bad scenario option {option!r} in {text!r} ({exc}); "
                    "options: prefix, chunk=N, pool=N, spec=K@A"
                ) from None
        if scenario.static and (scenario.prefix_caching or scenario.spec_tokens):
            raise ValueError(f"{text!r}: static batching takes no prefix cache or speculative decoding")
        return scenario


@dataclass
class RequestRecord:
    request_id: str
    arrival_s: float
    prompt_len: int
    output_len: int
    first_token_s: float | None = None
    finish_s: float | None = None
    cached_tokens: int = 0
    preemptions: int = 0


@dataclass
class SimulationResult:
    scenario: str
    records: list[RequestRecord]
    kv_timeline: list[tuple[float, float]] = field(default_factory=list)  # (time, used share of blocks)
    num_steps: int = 0
    num_preemptions: int = 0


@dataclass
class _Live:
    record: RequestRecord
    request: Request
    seq: Sequence


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"{value} is not positive")
    return value


def simulate(
    traffic: Traffic, scenario: Scenario, settings: EngineSettings, cost: CostModel, seed: int = 0
) -> SimulationResult:
    """Run `traffic` through the engine `settings` changed by `scenario`; deterministic in `seed`."""
    return _Simulation(traffic, scenario, settings, cost, seed).run()


class _Simulation:
    def __init__(
        self, traffic: Traffic, scenario: Scenario, settings: EngineSettings, cost: CostModel, seed: int
    ) -> None:
        self.scenario = scenario
        self.settings = settings
        self.cost = cost
        self.rng = random.Random(seed)
        budget = scenario.max_num_batched_tokens or settings.max_num_batched_tokens
        threshold = settings.long_prefill_token_threshold
        if scenario.static:  # a static batch prefills all its prompts in one forward
            budget = max(len(r.prompt_token_ids) for r in traffic.requests) * settings.max_num_seqs
            threshold = 0
        self.engine = EngineScheduler(
            scenario.num_kv_blocks or settings.num_kv_blocks, settings.block_size, settings.max_num_seqs,
            budget, scenario.prefix_caching, threshold,
        )  # fmt: skip
        self.clock = 0.0
        self.arrivals: list[tuple[float, int, Request]] = []  # heap by time sent, then order of release
        self.front_end_free = 0.0  # when the front end is done with the last request it took
        self.num_admitted = 0  # requests added to the engine since the last step
        self.released = 0
        self.backlog: deque[Request] = deque()  # closed loop: requests no client has sent yet
        self.queue: deque[tuple[float, Request]] = deque()  # arrived, not yet scheduled (static)
        self.live: dict[Sequence, _Live] = {}
        self.static_batch_size = 0
        self.result = SimulationResult(scenario.name, [])
        self._serve_history(traffic.history)
        if traffic.clients is None:
            for request in traffic.requests:
                self._release(request, request.arrival_s)
        else:
            self.backlog.extend(traffic.requests)
            for _ in range(min(traffic.clients, len(self.backlog))):
                self._release(self.backlog.popleft(), 0.0)

    def run(self) -> SimulationResult:
        while self.arrivals or self.queue or self.engine.has_unfinished:
            self._admit_arrivals()
            items = self.engine.step()
            if not items:
                if self.engine.has_unfinished:  # waiting work that the pool can never take
                    raise SimulationError("the scheduler cannot place any waiting request")
                if self.arrivals:
                    self.clock = max(self.clock, self._next_ready())
                continue
            self.clock += self._step_time(items) + self._front_end_time(items)
            self.result.num_steps += 1
            self._emit_tokens(items)
            self.result.kv_timeline.append((self.clock, self.engine.num_used_blocks / self.engine.num_blocks))
        self.result.num_preemptions = self.engine.num_preemptions
        return self.result

    def _serve_history(self, prompts: list[list[int]]) -> None:
        """Compute each prompt and finish it, in no time and unrecorded: what stays behind is
        the prefix cache's content."""
        for index, prompt in enumerate(prompts):
            seq = self.engine.add(f"history-{index}", prompt)
            while not any(item.samples and item.seq is seq for item in self.engine.step()):
                pass
            self.engine.finish(seq)

    # -- arrivals -----------------------------------------------------------------------------

    def _release(self, request: Request, at: float) -> None:
        needed = self.engine.blocks_needed(len(request.prompt_token_ids) + request.output_len)
        if needed > self.engine.num_blocks:
            raise SimulationError(
                f"request {request.request_id} needs {needed} KV blocks, more than the pool's "
                f"{self.engine.num_blocks}: give the simulation more blocks or shorter requests"
            )
        heapq.heappush(self.arrivals, (at, self.released, request))
        self.released += 1

    def _next_ready(self) -> float:
        """When the front end hands the engine the next request sent."""
        return max(self.arrivals[0][0], self.front_end_free) + self.cost.request_overhead_s

    def _admit_arrivals(self) -> None:
        while self.arrivals and (ready := self._next_ready()) <= self.clock:
            at, _, request = heapq.heappop(self.arrivals)
            self.front_end_free = ready
            self.queue.append((at, request))
        if self.scenario.static:
            if self.engine.has_unfinished or not self.queue:
                return
            self.static_batch_size = min(len(self.queue), self.settings.max_num_seqs)
            admitted = [self.queue.popleft() for _ in range(self.static_batch_size)]
        else:
            admitted, self.queue = list(self.queue), deque()
        for at, request in admitted:
            record = RequestRecord(request.request_id, at, len(request.prompt_token_ids), request.output_len)
            seq = self.engine.add(request.request_id, request.prompt_token_ids)
            self.live[seq] = _Live(record, request, seq)
        self.num_admitted += len(admitted)

    # -- one step -----------------------------------------------------------------------------

    def _step_time(self, items: list[StepItem]) -> float:
        if self.scenario.static:
            # Padding: every member of the batch, finished or not, computes the longest one's tokens.
            width = self.static_batch_size
            tokens = width * max(item.num_new_tokens for item in items)
            prefill = any(not item.decoding for item in items)
            kv_tokens = width * max(item.context_len for item in items)
            padded = StepShape(tokens if prefill else 0, 0 if prefill else tokens, kv_tokens, width)
            return self.cost.step_time(padded)
        k = self.scenario.spec_tokens
        if not k:
            return self.cost.step_time(StepShape.of(items))
        # The target verifies k drafts + 1 per decoding sequence; the draft model runs k times.
        decoding = [item for item in items if item.decoding]
        shape = StepShape.of(items)
        verified = replace(
            shape,
            num_decode_tokens=shape.num_decode_tokens + sum(k + 1 - item.num_new_tokens for item in decoding),
            num_kv_tokens=shape.num_kv_tokens + k * len(decoding),
        )
        draft = StepShape(0, len(decoding), sum(item.context_len for item in decoding), len(decoding))
        return self.cost.step_time(verified) + k * self.settings.draft_cost_ratio * self.cost.step_time(draft)

    def _front_end_time(self, items: list[StepItem]) -> float:
        """The front end's share of the step: the requests admitted since the last one, and an
        output streamed for each sequence that sampled."""
        num_requests, self.num_admitted = self.num_admitted, 0
        return self.cost.front_end_time(num_requests, sum(item.samples for item in items))

    def _emit_tokens(self, items: list[StepItem]) -> None:
        for item in items:
            if not item.samples:
                continue
            live = self.live[item.seq]
            record, seq = live.record, item.seq
            if record.first_token_s is None:
                record.first_token_s = self.clock
                record.cached_tokens = seq.num_cached_tokens
            count = 1
            if item.decoding:  # each draft is kept while all before it were: 1 + a run of accepts
                k, acceptance = self.scenario.spec_tokens, self.scenario.spec_acceptance
                while count <= k and self.rng.random() < acceptance:
                    count += 1
            count = min(count, record.output_len - seq.num_output_tokens)
            for _ in range(count):
                seq.append_token(self.rng.randrange(1, VOCAB_SIZE))
            if seq.num_output_tokens >= record.output_len:
                self._finish(live)

    def _finish(self, live: _Live) -> None:
        record, seq = live.record, live.seq
        record.finish_s = self.clock
        record.preemptions = seq.num_preemptions
        self.result.records.append(record)
        conversation = list(seq.all_token_ids)
        self.engine.finish(seq)
        del self.live[seq]
        turn = live.request.next_turn
        if turn is not None:
            follow_up = Request(
                f"{record.request_id}+", conversation + turn.user_token_ids, turn.output_len,
                self.clock + turn.think_s, turn.next_turn,
            )  # fmt: skip
            self._release(follow_up, follow_up.arrival_s)
        elif self.backlog:  # closed loop: this client sends its next request now
            self._release(self.backlog.popleft(), self.clock)
