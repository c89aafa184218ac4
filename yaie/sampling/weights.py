"""Unnormalised probabilities exp(logit - row max), as the truncation, the draw and the
logprobs all compute them: one formula keeps their results bit-identical."""

from __future__ import annotations

import torch

# exp() of anything below this gives a subnormal or zero float32, which x86 CPUs compute many
# times slower than normal values (low temperatures make such logits common;
# benchmarks/sampler.py runs low-temperature rows). Logits further than this below the row's
# maximum have odds under 1e-37 that no float64 running sum can resolve, so flooring their
# exponent here changes no draw.
EXP_FLOOR = -87.0


def exp_weights(logits: torch.Tensor, row_max: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """exp(logits - row_max) with the exponent floored at EXP_FLOOR; row_max is [n, 1]."""
    return torch.clamp(logits, min=row_max + EXP_FLOOR, out=out).sub_(row_max).exp_()


def logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise logsumexp of logits [n, V], with exponents floored at EXP_FLOOR."""
    row_max = logits.amax(dim=-1, keepdim=True)
    return row_max.squeeze(1) + exp_weights(logits, row_max).sum(dim=-1).log()
