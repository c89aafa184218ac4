"""Per-request controls of a pooling request (an embedding), named as in vLLM.

A pooling request runs its prompt through the model once (prefill only: nothing is sampled or
decoded) and returns one vector made from the final hidden states, after the model's last norm:
the last token's (`"last"`, what decoder models trained as embedders use, since only the last
token has seen the whole input) or the mean over every token (`"mean"`), L2-normalised unless
`normalize` is off.
"""

from __future__ import annotations

from dataclasses import dataclass

from yaie.errors import InvalidRequestError

# How a prompt's hidden states become one vector; EngineConfig.pooling is the default.
POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str | None = None  # one of POOLING_TYPES; None: the engine's `pooling`
    normalize: bool = True  # divide the vector by its L2 norm (vLLM's `normalize`)

    def __post_init__(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            choices = ", ".join(POOLING_TYPES)
            raise InvalidRequestError(
                f"pooling_type: must be one of {choices}, got {self.pooling_type!r}", "pooling_type"
            )
