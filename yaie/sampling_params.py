"""Per-request generation controls, named as in vLLM (which extends OpenAI's names)."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass, field

from yaie.errors import InvalidRequestError
from yaie.structured.spec import StructuredOutputs, ToolCallSpans

MAX_STOP_SEQUENCES = 16
MAX_LOGPROBS = 20
# Temperatures below this sample greedily (as in vLLM). Dividing logits by less would overflow
# float32 to infinity, whose softmax is NaN: there is no distribution left to draw from, and a
# temperature this small means "the most likely token" anyway.
GREEDY_TEMPERATURE = 1e-5
MAX_TOP_K = 2**31 - 1  # top_k counts tokens; anything larger is no vocabulary's size
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"
)  # fmt: skip


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: until the model's context is full
    min_tokens: int = 0
    logprobs: int | None = None  # number of top alternatives per sampled token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output constrained to a JSON schema, regex, choice or grammar (yaie/structured/). The
    # constraint spans the whole output, so no stop string or stop token applies to it.
    structured_outputs: StructuredOutputs | None = None
    # yaie's: tool calls the free text may hold (tool_choice "auto"), which no stop string or
    # stop token cuts (yaie/structured/spec.py).
    tool_call_spans: ToolCallSpans | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.validate()
        if self.temperature < GREEDY_TEMPERATURE:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        """Whether this request takes the most likely token: temperature 0, or below
        GREEDY_TEMPERATURE (which __post_init__ turns into 0)."""
        return self.temperature == 0.0

    def ending_token_ids(self, eos_token_ids: Collection[int]) -> set[int]:
        """The one stop rule for tokens: these ids end a sequence once it has `min_tokens` output
        tokens (the engine stops on them), and until then they may not be sampled (the sampler
        bans them). With `ignore_eos`, EOS is an ordinary token. With structured outputs, so
        are stop tokens: one inside the constrained output would cut it short, and the grammar
        ends the sequence itself once its output is complete (allowing EOS only then)."""
        stop_token_ids = set() if self.structured_outputs is not None else set(self.stop_token_ids)
        return stop_token_ids if self.ignore_eos else {*stop_token_ids, *eos_token_ids}

    def validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param}: {message}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be at least 1, got {self.n}")
        # NaN compares false with everything, so it would slip through every range check below.
        for name in FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise bad(name, f"must be a finite number, got {getattr(self, name)}")
        if self.temperature < 0.0:
            raise bad("temperature", f"must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= MAX_TOP_K:
            raise bad("top_k", f"must be -1 (disabled) or an integer in [0, {MAX_TOP_K}], got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            raise bad("min_tokens", f"must be in [0, max_tokens], got {self.min_tokens}")
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad("stop", f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "stop sequences must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")
        for token_id, bias in self.logit_bias.items():
            if not isinstance(token_id, int) or token_id < 0:
                raise bad("logit_bias", f"keys must be token ids, got {token_id!r}")
            if not -100.0 <= bias <= 100.0:  # also false for NaN
                raise bad("logit_bias", f"biases must be in [-100, 100], got {bias}")
