"""A request: what a user sent (one prompt, its parameters) and the choices that answer it.
Each choice is a `Sequence` for the scheduler plus the text the user sees. A pooling request
(`PoolingParams`) has one choice, which only computes the prompt, and its vector as it builds."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from yaie.config import SCHEDULING_POLICIES
from yaie.engine.detokenizer import IncrementalDetokenizer
from yaie.engine.sequence import ANONYMOUS_TENANT, Sequence
from yaie.errors import InvalidRequestError
from yaie.outputs import TokenLogprob
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from yaie.structured.tools import CallSpans


@dataclass
class Choice:
    """One of a request's n completions: its sequence and what has been made of its tokens."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer | None  # None for a pooling request: it makes no text
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asked
    finish_reason: str | None = None  # set once, when the sequence finishes
    # Where the text's tool calls are, which stop strings and stop tokens do not cut: for a
    # request with stop rules whose free text may hold calls (SamplingParams.tool_call_spans).
    call_spans: CallSpans | None = None
    # How much of `text` and of the output tokens earlier outputs already handed out as deltas.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0


@dataclass
class Request:
    request_id: str
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams
    choices: list[Choice] = field(default_factory=list)
    # Filled as the prompt is computed, when the request asked for prompt logprobs. Position 0
    # has nothing before it to predict it, so its entry is None (as in vLLM).
    prompt_logprobs: list[TokenLogprob | None] | None = None
    priority: int = 0  # under the priority policy, lower runs first (vLLM's convention)
    tenant: str = ANONYMOUS_TENANT  # who sent it: the engine is shared fairly between tenants
    # The time.monotonic() instant by which the request ends, finished or not (its `timeout`).
    deadline: float | None = None
    # A mean-pooling request's sum of final hidden states over the prompt computed so far.
    pooled_sum: torch.Tensor | None = None

    @property
    def sampling_params(self) -> SamplingParams:
        """A generation request's parameters. Only requests whose sequences sample ask for them."""
        if not isinstance(self.params, SamplingParams):
            raise TypeError(f"{self.request_id} is a pooling request: it has no sampling parameters")
        return self.params

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)


def deadline_after(timeout: float | None) -> float | None:
    """The time.monotonic() instant `timeout` seconds from now (None: no deadline); raises
    InvalidRequestError unless it is a positive, finite number of seconds."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
        message = f"timeout: must be a positive number of seconds, got {timeout!r}"
        raise InvalidRequestError(message, "timeout")
    return time.monotonic() + timeout


def check_priority(priority: int, policy: str) -> None:
    """A request's priority is an integer, and other than 0 only under the priority policy
    (as vLLM, which refuses it under fcfs rather than ignore what the client asked for)."""
    assert policy in SCHEDULING_POLICIES
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidRequestError(f"priority: must be an integer, got {priority!r}", "priority")
    if priority != 0 and policy != "priority":
        raise InvalidRequestError(
            f"priority: got {priority}, but priority scheduling is not enabled: under the fcfs policy "
            "every request's priority is 0 (start the engine with --scheduling-policy priority)",
            "priority",
        )
