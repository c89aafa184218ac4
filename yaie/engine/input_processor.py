"""`InputProcessor`: from what a user sent to a request the engine can run (vLLM's name).

It owns the tokenizer's side of a request: encoding a text prompt, rendering a conversation
through the model's chat template (tools included, yaie/structured/tools.py), compiling a
structured-output grammar, and the checks only the model can make (the vocabulary, the
context length). Every method is thread-safe and touches no engine state, so the server runs
them on its tokenizer threads (yaie/engine/async_engine.py) and hands the engine thread a
`ProcessedRequest`: encoding a huge prompt or compiling a new schema holds up no step.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from yaie.errors import InvalidRequestError
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams
from yaie.structured.backend import Grammar, GrammarCompiler
from yaie.structured.spec import StructuredOutputs
from yaie.structured.tools import hermes_messages, template_knows_tools

# apply_chat_template's own parameters and the variables encode_chat gives the template: a
# request's chat_template_kwargs may not set them (they would change what the call returns).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "raise_exception", "strftime_now",  # the functions transformers gives templates
})  # fmt: skip


@dataclass(frozen=True)
class ProcessedRequest:
    """A request checked and ready to queue: `Engine.add_processed_request` takes it."""

    prompt: str | None  # the text, when the prompt came as text
    prompt_token_ids: list[int]
    params: SamplingParams | PoolingParams  # a generation or a pooling (embedding) request
    grammar: Grammar | None  # compiled from params.structured_outputs, when it has any

    @property
    def num_seqs(self) -> int:
        """The sequences it becomes: one per choice (a pooling request has one)."""
        return self.params.n if isinstance(self.params, SamplingParams) else 1


class InputProcessor:
    def __init__(
        self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: Collection[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self._grammar_compiler: GrammarCompiler | None = None  # built by the first structured request
        self._grammar_compiler_lock = threading.Lock()

    def process(self, prompt: str | list[int], params: SamplingParams | PoolingParams) -> ProcessedRequest:
        """Tokenize, check and compile; raises InvalidRequestError for input we refuse."""
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check(token_ids, params)
        spec = params.structured_outputs if isinstance(params, SamplingParams) else None
        return ProcessedRequest(text, token_ids, params, self.compile_grammar(spec) if spec else None)

    def encode(self, text: str) -> list[int]:
        """Token ids of a text prompt."""
        return list(self.tokenizer(text).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids))

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of a conversation through the model's own chat template, ready to answer.
        `tools` (OpenAI tool definitions) go to a template that renders them; for one that does
        not, they, the calls and the tool results are written in the Hermes style
        (yaie/structured/tools.py). `chat_template_kwargs` are more variables for the template
        (vLLM's request field: `enable_thinking` for Qwen3's), none of them one it is given here."""
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(chat_template_kwargs or {})
        if reserved:
            param = "chat_template_kwargs"
            names = ", ".join(sorted(reserved))
            raise InvalidRequestError(f"{param}: {names} cannot be set here (the server sets it)", param)
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        template = getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise InvalidRequestError("this model has no chat template; use a plain prompt", "messages")
        extra: dict[str, Any] = dict(chat_template_kwargs or {})
        if template_knows_tools(template):
            extra |= {"tools": tools} if tools else {}
        elif tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            messages = hermes_messages(messages, tools)
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, **extra
            )
        except TemplateError as exc:  # templates raise on conversations they do not accept
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}", "messages") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            if not chat_template_kwargs:
                raise
            # A variable of a type the template cannot use ("enable_thinking": [1]) is the request's fault.
            param = "chat_template_kwargs"
            raise InvalidRequestError(f"{param}: the chat template failed on them: {exc}", param) from exc
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    def compile_grammar(self, spec: StructuredOutputs) -> Grammar:
        """The compiled grammar for `spec`, cached; raises InvalidRequestError for one the grammar
        library refuses."""
        with self._grammar_compiler_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_compiler.compile(spec)

    def check(self, token_ids: list[int], params: SamplingParams | PoolingParams) -> None:
        """What only the model knows: the vocabulary and the context length. (SamplingParams
        checks its own values.) This is the one place token ids are checked against the vocabulary."""
        if not token_ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", "prompt")
        if isinstance(params, PoolingParams):  # generates nothing: the prompt alone must fit
            if len(token_ids) > self.max_model_len:
                raise InvalidRequestError(
                    f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len}",
                    "prompt",
                )
            return
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise InvalidRequestError(
                    f"{name}: token ids must be below the vocabulary size {vocab}", param=name
                )
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens; this model's context is {self.max_model_len}",
                "prompt",
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise InvalidRequestError(
                f"max_tokens={params.max_tokens} plus the prompt's {len(token_ids)} tokens exceeds this "
                f"model's context of {self.max_model_len} tokens",
                "max_tokens",
            )
