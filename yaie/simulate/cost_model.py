"""How long one engine step takes, from the shape of the batch it runs.

    step time = fixed + per_token * tokens computed + per_kv_token * K/V tokens read
                + per_sample * sequences sampled

`fixed` is what every step pays whatever its size (on a GPU: reading the weights once; on a
CPU: Python and kernel launches), `per_token` the matmuls each new token goes through,
`per_kv_token` attention reading the cache, `per_sample` the LM head and sampler, which only
rows that sample pay (a prefill chunk that does not reach the prompt's end samples nothing).
The coefficients come from a roofline of a planned model on an accelerator, or are fitted by
least squares to step times `yaie bench --fit-cost-model` measured on the real engine.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from yaie.plan import Plan


@dataclass(frozen=True)
class StepShape:
    num_tokens: int  # tokens whose K/V the step computes
    num_kv_tokens: int  # K/V tokens attention reads: each scheduled sequence's context through this step
    num_sampled: int  # sequences that sample a token

    def features(self) -> list[float]:
        return [1.0, float(self.num_tokens), float(self.num_kv_tokens), float(self.num_sampled)]


@dataclass(frozen=True)
class CostModel:
    fixed_s: float
    per_token_s: float
    per_kv_token_s: float
    per_sample_s: float = 0.0
    # The engine settings the coefficients were measured under (block_size, num_kv_blocks,
    # max_num_seqs, max_num_batched_tokens, ...), so a simulation can mirror that engine.
    engine: dict[str, Any] = field(default_factory=dict)

    def step_time(self, shape: StepShape) -> float:
        return (
            self.fixed_s
            + self.per_token_s * shape.num_tokens
            + self.per_kv_token_s * shape.num_kv_tokens
            + self.per_sample_s * shape.num_sampled
        )

    @classmethod
    def roofline(cls, plan: Plan, bandwidth: float, flops: float) -> CostModel:
        """An accelerator that streams `bandwidth` bytes/s and computes `flops` FLOP/s per GPU:
        every step reads the GPU's weights once, every token costs two FLOPs per active parameter,
        every K/V token read costs its bytes. Adding the terms instead of taking the larger one
        makes this a little pessimistic where compute and memory traffic overlap."""
        tp = plan.tensor_parallel_size
        return cls(
            fixed_s=plan.weight_bytes_per_gpu / bandwidth,
            per_token_s=2 * plan.num_active_parameters / tp / flops,
            per_kv_token_s=plan.kv_bytes_per_token_per_gpu / bandwidth,
            engine={"block_size": plan.block_size, "num_kv_blocks": plan.kv_budget_blocks},
        )

    @classmethod
    def fit(
        cls, shapes: list[StepShape], seconds: list[float], engine: dict[str, Any] | None = None
    ) -> CostModel:
        """Least squares with every coefficient kept non-negative (a negative cost would let the
        simulator gain time by adding work): fit, drop the most negative term, fit again."""
        import numpy as np

        if len(shapes) != len(seconds) or len(shapes) < 4:
            raise ValueError(f"need at least 4 timed steps to fit 4 coefficients, got {len(shapes)}")
        features = np.array([shape.features() for shape in shapes])
        target = np.array(seconds)
        active = list(range(features.shape[1]))
        while True:
            solution, *_ = np.linalg.lstsq(features[:, active], target, rcond=None)
            if solution.min() >= 0 or len(active) == 1:
                break
            del active[int(solution.argmin())]
        coefficients = [0.0] * features.shape[1]
        for index, value in zip(active, solution, strict=True):
            coefficients[index] = max(0.0, float(value))
        return cls(*coefficients, engine=dict(engine or {}))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        try:
            return cls(
                fixed_s=float(data["fixed_s"]),
                per_token_s=float(data["per_token_s"]),
                per_kv_token_s=float(data["per_kv_token_s"]),
                per_sample_s=float(data.get("per_sample_s", 0.0)),
                engine=dict(data.get("engine") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            needs = "fixed_s, per_token_s, per_kv_token_s"
            raise ValueError(f"not a cost model ({exc!r}): it needs {needs}") from None

    @classmethod
    def load(cls, path: Path) -> CostModel:
        return cls.from_json(json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
