"""What one engine step computed, in the four numbers its time depends on, and their running sums.

A step's cost is set by its shape, not by whose tokens it carries: how many prompt tokens it
computes (many rows at a time), how many decode tokens (one row per sequence, more when it
verifies drafts), how many K/V tokens attention reads, and how many rows reach the LM head and
the sampler. `yaie simulate` prices shapes with a cost model (yaie/simulate/cost_model.py);
the engine sums the shapes of the steps it runs, with their times (`StepTotals`), and the server
exports the sums (/metrics), so that a load test can see what the engine computed and how long
that took, and the cost model can be checked against a real server.

Pure Python: no torch, like the scheduler whose steps it counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


class Scheduled(Protocol):
    """One sequence's part of a step, as a shape counts it (ScheduledSequence has these)."""

    @property
    def num_new_tokens(self) -> int: ...
    @property
    def decoding(self) -> bool: ...
    @property
    def context_len(self) -> int: ...
    @property
    def samples(self) -> bool: ...


@dataclass(frozen=True)
class StepShape:
    num_prefill_tokens: int  # prompt (or recomputed) tokens whose K/V the step computes
    num_decode_tokens: int  # tokens of sequences past their prompt: one each, more when verifying drafts
    num_kv_tokens: int  # K/V tokens attention reads: each scheduled sequence's context through this step
    num_sampled: int  # sequences that sample a token

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @classmethod
    def of(cls, items: Iterable[Scheduled]) -> StepShape:
        """The shape of a step of these items: a SchedulerOutput's `scheduled` (taken before
        `Scheduler.update` moves the counts), or the simulator's record of them."""
        prefill = decode = kv = sampled = 0
        for item in items:
            if item.decoding:
                decode += item.num_new_tokens
            else:
                prefill += item.num_new_tokens
            kv += item.context_len
            sampled += item.samples
        return cls(prefill, decode, kv, sampled)


@dataclass
class StepTotals:
    """Sums over every step an engine ran: its shapes and the seconds the steps took."""

    num_steps: int = 0
    num_prefill_steps: int = 0  # steps that computed any prompt tokens
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_kv_tokens: int = 0
    num_sampled: int = 0
    busy_s: float = 0.0

    def add(self, shape: StepShape, seconds: float) -> None:
        self.num_steps += 1
        self.num_prefill_steps += shape.num_prefill_tokens > 0
        self.num_prefill_tokens += shape.num_prefill_tokens
        self.num_decode_tokens += shape.num_decode_tokens
        self.num_kv_tokens += shape.num_kv_tokens
        self.num_sampled += shape.num_sampled
        self.busy_s += seconds


# How the server exports StepTotals' fields (/metrics counters, "_total" appended): (field,
# metric name, help). `yaie bench` reads the same names to get each load level's sums.
STEP_METRICS = (
    ("num_steps", "engine_steps", "Engine steps run."),
    ("busy_s", "engine_step_seconds", "Seconds the engine spent in its steps."),
    ("num_prefill_steps", "engine_prefill_steps", "Steps that computed prompt (or recomputed) tokens."),
    ("num_prefill_tokens", "engine_prefill_tokens", "Prompt (or recomputed) tokens computed."),
    ("num_decode_tokens", "engine_decode_tokens", "Tokens computed past their prompt (drafts included)."),
    ("num_kv_tokens", "engine_kv_tokens_read", "K/V tokens attention read, summed over steps."),
    ("num_sampled", "engine_sampled_rows", "Rows that sampled a token."),
)
