"""How long one engine step takes, from the shape of the batch it runs.

    step time = fixed + prefill_step × (1 if the step computes any prompt token)
                + per_prefill_token × prompt tokens computed + per_decode_token × decode tokens
                + per_kv_token × K/V tokens read + per_sample × sequences sampled

`fixed` is what every step pays whatever its size (on a GPU: reading the weights once; on a
CPU: Python and kernel launches). `prefill_step` is what a step pays on top once it carries any
prompt (or recomputed) tokens: on this engine's CPU path a step of decodes only runs each layer
in one native call (yaie/model/fused_decode.py), while a step with a prompt chunk runs the
layers' Python forward. `per_prefill_token` and `per_decode_token` are the matmuls a token goes
through; they differ because a prompt's rows are multiplied many at a time (quantized weights:
through dequantized tiles) and a decode's one row per sequence. `per_kv_token` is attention
reading the cache, `per_sample` the LM head and sampler, which only rows that sample pay (a
prefill chunk that does not reach the prompt's end samples nothing).

`request_overhead` is not a step: it is the time a request spends outside the engine before it
is queued (HTTP, the chat template, tokenizing), one request after another, as the server's
event loop handles them. The simulator delays each arrival by it.

The coefficients come from a roofline of a planned model on an accelerator, or are fitted by
least squares to step times `yaie bench --fit-cost-model` measured on the real engine. A file
from before prefill and decode tokens were priced apart (one `per_token_s`) loads with that
price for both and no per-step prefill cost.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yaie.plan import Plan

COEFFICIENTS = (
    "fixed_s", "prefill_step_s", "per_prefill_token_s", "per_decode_token_s", "per_kv_token_s", "per_sample_s"
)  # fmt: skip


@dataclass(frozen=True)
class StepShape:
    num_prefill_tokens: int  # prompt (or recomputed) tokens whose K/V the step computes
    num_decode_tokens: int  # tokens of sequences past their prompt: one each, more when verifying drafts
    num_kv_tokens: int  # K/V tokens attention reads: each scheduled sequence's context through this step
    num_sampled: int  # sequences that sample a token

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def features(self) -> list[float]:
        """The multipliers of COEFFICIENTS, in order."""
        return [
            1.0,
            1.0 if self.num_prefill_tokens else 0.0,
            float(self.num_prefill_tokens),
            float(self.num_decode_tokens),
            float(self.num_kv_tokens),
            float(self.num_sampled),
        ]


@dataclass(frozen=True)
class CostModel:
    fixed_s: float
    prefill_step_s: float
    per_prefill_token_s: float
    per_decode_token_s: float
    per_kv_token_s: float
    per_sample_s: float = 0.0
    request_overhead_s: float = 0.0
    # The engine settings the coefficients were measured under (block_size, num_kv_blocks,
    # max_num_seqs, max_num_batched_tokens, ...), so a simulation can mirror that engine.
    engine: dict[str, Any] = field(default_factory=dict)

    def step_time(self, shape: StepShape) -> float:
        coefficients: list[float] = [getattr(self, name) for name in COEFFICIENTS]
        return sum(c * x for c, x in zip(coefficients, shape.features(), strict=True))

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
        """Least squares with every coefficient kept non-negative (a negative cost would let the
        simulator gain time by adding work): fit, drop the most negative term, fit again.

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
        features = np.array([shape.features() for shape in shapes]) * weights[:, None]
        active = [i for i in range(features.shape[1]) if features[:, i].any()]  # unseen: cost 0
        solution: Any = np.zeros(0)
        while active:
            solution, *_ = np.linalg.lstsq(features[:, active], target * weights, rcond=None)
            if solution.min() >= 0:
                break
            del active[int(solution.argmin())]
        coefficients = dict.fromkeys(COEFFICIENTS, 0.0)
        for index, value in zip(active, solution, strict=True):
            coefficients[COEFFICIENTS[index]] = float(value)
        return cls(**coefficients, request_overhead_s=request_overhead_s, engine=dict(engine or {}))

    def describe(self) -> str:
        return (
            f"step time = {self.fixed_s * 1e3:.2f} ms + {self.prefill_step_s * 1e3:.2f} ms if any prompt "
            f"tokens + {self.per_prefill_token_s * 1e6:.1f} us/prompt token + "
            f"{self.per_decode_token_s * 1e6:.1f} us/decode token + "
            f"{self.per_kv_token_s * 1e9:.2f} ns/KV token read + {self.per_sample_s * 1e6:.1f} us/sample; "
            f"{self.request_overhead_s * 1e3:.2f} ms per request before the engine"
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
