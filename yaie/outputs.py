"""What the engine returns, in vLLM's shape: one RequestOutput per prompt, with its generated
completions, or, for a pooling request, its pooled vector."""

from __future__ import annotations

from dataclasses import dataclass, field

from yaie.errors import YaieError


@dataclass
class TokenLogprob:
    """Log-probability of one generated (or prompt) token, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # Once finished: "stop" | "length" | "abort" | "timeout" (the request's deadline passed).
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None
    # What this output adds to the previous one for the same request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class PoolingOutput:
    """A pooling request's vector (yaie/pooling_params.py), as float32 values."""

    data: list[float]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # A pooling request's result (its `outputs` is empty); None for a generation request.
    pooled: PoolingOutput | None = None
    # Set when the request failed (alone: the others go on): it is finished, and what it
    # generated so far is all it will get. A RequestFailedError when the engine failed on it, an
    # InvalidRequestError when its own input turned out to be more than the engine can run (a
    # grammar the library gave up on mid-way).
    error: YaieError | None = None
