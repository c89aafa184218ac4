"""yaie: Yet Another Inference Engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from yaie.config import EngineConfig
from yaie.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from yaie.outputs import CompletionOutput, PoolingOutput, RequestOutput
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams

if TYPE_CHECKING:
    from yaie.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "PoolingOutput",
    "PoolingParams",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    # LLM imports torch; the torch-free parts (the scheduler, `yaie simulate`, `yaie plan`) must
    # be importable without paying for it, so it is imported on first use.
    if name == "LLM":
        from yaie.llm import LLM

        return LLM
    raise AttributeError(f"module 'yaie' has no attribute {name!r}")
