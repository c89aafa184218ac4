"""How long one engine step takes, from the shape of the batch it runs.

    step time = fixed + prefill_step × (1 if the step computes any prompt token)
                + per_prefill_token × prompt tokens computed + per_decode_token × decode tokens
                + per_kv_token × K/V tokens read + per_sample × sequences sampled

`fixed` is what every step pays whatever its size (on a GPU: reading the weights once; on a
CPU: Python and kernel launches). `prefill_step` is what a step pays on top once it carries any
prompt (or recomputed) tokens: on this engine's CPU path a step of decodes only runs all the
layers in one native call (yaie/model/fused_decode.py), while a step with a prompt chunk runs the
layers' Python forward. `per_prefill_token` and `per_decode_token` are the matmuls a token goes
through; they differ because a prompt's rows are multiplied many at a time (sharing each unpacked
weight block) and a decode's one row per sequence. `per_kv_token` is attention
reading the cache, `per_sample` the LM head and sampler, which only rows that sample pay (a
prefill chunk that does not reach the prompt's end samples nothing).

The server's front end (HTTP, the chat template, tokenizing, streaming each output as an SSE
event) is priced apart from the engine, in three terms. `request_overhead` is the time a request
spends outside the engine, one request after another as the server's event loop handles them:
the simulator delays each arrival by it. `front_end_per_request` and `front_end_per_output` are
what that work costs the engine's steps where the front end and the engine share the CPU (this
project's 2-core machines): each request the step admits and each output it streams (one per
sequence that sampled) lengthens the step by that much. A machine with cores to spare measures
them near zero.

The coefficients come from a roofline of a planned model on an accelerator, or are fitted by
least squares to step times `yaie bench --fit-cost-model` measured on the real engine, and the
front end's from the same command's load test of a real server (`with_front_end`). A file
from before prefill and decode tokens were priced apart (one `per_token_s`) loads with that
price for both and no per-step prefill cost.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from yaie.engine.step_shape import StepShape, StepTotals

if TYPE_CHECKING:
    from yaie.plan import Plan

COEFFICIENTS = (
    "fixed_s", "prefill_step_s", "per_prefill_token_s", "per_decode_token_s", "per_kv_token_s", "per_sample_s"
)  # fmt: skip


def step_features(shape: StepShape) -> list[float]:
    """The multipliers of COEFFICIENTS for one step, in order."""
    return [
        1.0,
        1.0 if shape.num_prefill_tokens else 0.0,
        float(shape.num_prefill_tokens),
        float(shape.num_decode_tokens),
        float(shape.num_kv_tokens),
        float(shape.num_sampled),
    ]


def totals_features(totals: StepTotals) -> list[float]:
    """The multipliers of COEFFICIENTS summed over the steps of `totals` (the model is linear)."""
    return [
        float(totals.num_steps),
        float(totals.num_prefill_steps),
        float(totals.num_prefill_tokens),
        float(totals.num_decode_tokens),
        float(totals.num_kv_tokens),
        float(totals.num_sampled),
    ]


@dataclass(frozen=True)
class ServedLevel:
    """One load-test level as a server saw it: the sums of its engine's steps over the level
    (the difference of the server's StepTotals before and after), the requests it served, the
    clients that sent them, and the level's wall-clock time."""

    totals: StepTotals
    num_requests: int
    clients: int
    wall_s: float


@dataclass(frozen=True)
class CostModel:
    fixed_s: float
    prefill_step_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_kv_token_s: float
    per_sample_s: float = 0.0
    request_overhead_s: float = 0.0
    front_end_per_request_s: float = 0.0
    front_end_per_output_s: float = 0.0
    # The engine settings the coefficients were measured under (block_size, num_kv_blocks,
    # max_num_seqs, max_num_batched_tokens, ...), so a simulation can mirror that engine.
    engine: dict[str, Any] = field(default_factory=dict)

    def step_time(self, shape: StepShape) -> float:
        coefficients: list[float] = [getattr(self, name) for name in COEFFICIENTS]
        return sum(c * x for c, x in zip(coefficients, step_features(shape), strict=True))

    def front_end_time(self, num_requests: int, num_outputs: int) -> float:
        """What the front end adds to a step that admits `num_requests` requests and streams
        `num_outputs` outputs."""
        return self.front_end_per_request_s * num_requests + self.front_end_per_output_s * num_outputs

    @classmethod
    def roofline(cls, plan: Plan, bandwidth: float, flops: float) -> CostModel:
        """An accelerator that streams `bandwidth` bytes/s and computes `flops` FLOP/s per GPU:
        every step reads the GPU's weights once, every token costs two FLOPs per active parameter,
        every K/V token read costs its bytes. Adding the terms instead of taking the larger one
        makes this a little pessimistic where compute and memory traffic overlap."""
        tp = plan.tensor_parallel_size
        per_token = 2 * plan.num_active_parameters / tp / flops
        return cls(
            fixed_s=plan.weight_bytes_per_gpu / bandwidth,
            prefill_step_s=0.0,
            per_prefill_token_s=per_token,
            per_decode_token_s=per_token,
            per_kv_token_s=plan.kv_bytes_per_token_per_gpu / bandwidth,
            engine={"block_size": plan.block_size, "num_kv_blocks": plan.kv_budget_blocks},
        )

    @classmethod
    def fit(
        cls,
        shapes: list[StepShape],
        seconds: list[float],
        engine: dict[str, Any] | None = None,
        request_overhead_s: float = 0.0,
    ) -> CostModel:
        """Non-negative least squares of the step times over the steps' shapes.

        Each step is weighted by 1 / its time, so the error minimised is the relative one: a
        many-thousand-token prefill must not buy its fit with the decode steps that make up most
        of a run. The steps must vary every feature independently (prefill-only, decode-only and
        mixed steps, several prompts finishing in one step), or the split between the
        coefficients of features that moved together is arbitrary."""
        import numpy as np

        if len(shapes) != len(seconds) or len(shapes) < len(COEFFICIENTS):
            raise ValueError(
                f"need at least {len(COEFFICIENTS)} timed steps to fit {len(COEFFICIENTS)} coefficients, "
                f"got {len(shapes)}"
            )
        if min(seconds) <= 0:
            raise ValueError("step times must be positive")
        target = np.array(seconds)
        weights = 1.0 / target
        features = np.array([step_features(shape) for shape in shapes]) * weights[:, None]
        solution = _non_negative_least_squares(features, target * weights)
        coefficients = {name: float(value) for name, value in zip(COEFFICIENTS, solution, strict=True)}
        return cls(**coefficients, request_overhead_s=request_overhead_s, engine=dict(engine or {}))

    def with_front_end(self, levels: list[ServedLevel]) -> CostModel:
        """This engine model with the front end's terms measured from load-test levels of a
        real server running the same engine.

        One client keeps at most one request in flight, so whatever of a one-client level's
        wall time the engine was not stepping is the requests' time outside it, one after
        another: `request_overhead` is that, per request. With many clients the front end
        works while the engine steps, and what it costs them is what the steps took beyond
        this model's price for the same shapes: least squares of that excess over the levels'
        requests and outputs gives `front_end_per_request` and `front_end_per_output`. Levels
        must differ in their ratio of requests to outputs (other output lengths) for the two
        to come apart."""
        import numpy as np

        single = [level for level in levels if level.clients == 1]
        many = [level for level in levels if level.clients > 1]
        if not single or len(many) < 2:
            raise ValueError("need a one-client level and two or more levels of several clients")
        idle = sum(level.wall_s - level.totals.busy_s for level in single)
        overhead = max(0.0, idle / sum(level.num_requests for level in single))
        coefficients = np.array([getattr(self, name) for name in COEFFICIENTS])
        excess = np.array(
            [level.totals.busy_s - coefficients @ totals_features(level.totals) for level in many]
        )
        features = np.array([[level.num_requests, level.totals.num_sampled] for level in many], dtype=float)
        # Weighted by 1 / busy time, as in `fit`: each level's error counts relative to its length.
        weights = 1.0 / np.array([level.totals.busy_s for level in many])
        per_request, per_output = _non_negative_least_squares(features * weights[:, None], excess * weights)
        return replace(
            self,
            request_overhead_s=overhead,
            front_end_per_request_s=float(per_request),
            front_end_per_output_s=float(per_output),
        )

    def describe(self) -> str:
        return (
            f"step time = {self.fixed_s * 1e3:.2f} ms + {self.prefill_step_s * 1e3:.2f} ms if any prompt "
            f"tokens + {self.per_prefill_token_s * 1e6:.1f} us/prompt token + "
            f"{self.per_decode_token_s * 1e6:.1f} us/decode token + "
            f"{self.per_kv_token_s * 1e9:.2f} ns/KV token read + {self.per_sample_s * 1e6:.1f} us/sample; "
            f"{self.request_overhead_s * 1e3:.2f} ms per request before the engine; the front end adds "
            f"{self.front_end_per_request_s * 1e3:.2f} ms a request + "
            f"{self.front_end_per_output_s * 1e6:.1f} us an output to the step"
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        try:
            if "per_prefill_token_s" not in data and "per_token_s" in data:  # one price for both
                data = {**data, "per_prefill_token_s": data["per_token_s"]}
                data.setdefault("per_decode_token_s", data["per_token_s"])
            return cls(
                fixed_s=float(data["fixed_s"]),
                prefill_step_s=float(data.get("prefill_step_s", 0.0)),
                per_prefill_token_s=float(data["per_prefill_token_s"]),
                per_decode_token_s=float(data["per_decode_token_s"]),
                per_kv_token_s=float(data["per_kv_token_s"]),
                per_sample_s=float(data.get("per_sample_s", 0.0)),
                request_overhead_s=float(data.get("request_overhead_s", 0.0)),
                front_end_per_request_s=float(data.get("front_end_per_request_s", 0.0)),
                front_end_per_output_s=float(data.get("front_end_per_output_s", 0.0)),
                engine=dict(data.get("engine") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            needs = "fixed_s, per_prefill_token_s, per_decode_token_s (or per_token_s), per_kv_token_s"
            raise ValueError(f"not a cost model ({exc!r}): it needs {needs}") from None

    @classmethod
    def load(cls, path: Path) -> CostModel:
        return cls.from_json(json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _non_negative_least_squares(features: Any, target: Any) -> Any:
    """Least squares with every coefficient kept non-negative (a negative cost would let the
    simulator gain time by adding work): fit, drop the most negative term, fit again. A feature
    that never moves gets 0."""
    import numpy as np

    solution = np.zeros(features.shape[1])
    active = [i for i in range(features.shape[1]) if features[:, i].any()]
    while active:
        values, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
        if values.min() >= 0:
            solution[active] = values
            break
        del active[int(values.argmin())]
    return solution
