"""yaie: Yet Another Inference Engine."""

from yaie.config import EngineConfig
from yaie.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from yaie.llm import LLM
from yaie.outputs import CompletionOutput, RequestOutput
from yaie.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "InvalidRequestError",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "UnsupportedModelError",
    "__version__",
]
