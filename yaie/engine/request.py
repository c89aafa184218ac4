"""A request: what a user sent (one prompt, its sampling parameters) and the n choices that
answer it. Each choice is a `Sequence` for the scheduler plus the text the user sees."""

from __future__ import annotations

from dataclasses import dataclass, field

from yaie.engine.detokenizer import IncrementalDetokenizer
from yaie.engine.sequence import Sequence
from yaie.outputs import TokenLogprob
from yaie.sampling_params import SamplingParams


@dataclass
class Choice:
    """One of a request's n completions: its sequence and what has been made of its tokens."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprob] | None = None  # one per output token, when the request asked
    finish_reason: str | None = None  # set once, when the sequence finishes
    # How much of `text` and of the output tokens earlier outputs already handed out as deltas.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0


@dataclass
class Request:
    request_id: str
    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[Choice] = field(default_factory=list)
    # Filled as the prompt is computed, when the request asked for prompt logprobs. Position 0
    # has nothing before it to predict it, so its entry is None (as in vLLM).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason is not None for choice in self.choices)
