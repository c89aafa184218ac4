"""The OpenAI API's request and response shapes, and their mapping onto SamplingParams.

Requests ignore fields they do not know (clients send many we have no use for), but are strict
about the ones they do: a string where a number belongs is an error, as with OpenAI, not
something to coerce. Range checks live in SamplingParams, except for limits only the API has
(n, seed); `to_sampling_params` translates its errors back to the request's own field names.

A sampling field a request leaves out (or sends as null) takes the model's default when the
server has one (yaie/generation_config.py), else SamplingParams' own.
"""

from __future__ import annotations

import base64
import json
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Annotated, Any, Literal, cast

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import ErrorDetails, PydanticCustomError

from yaie.errors import InvalidRequestError
from yaie.outputs import TokenLogprob
from yaie.sampling_params import SamplingParams
from yaie.structured.spec import PARAM as STRUCTURED_OUTPUTS
from yaie.structured.spec import StructuredOutputs, ToolCallSpans
from yaie.structured.tool_formats import HERMES, ToolFormat

MAX_N = 128  # OpenAI's limit on choices per request
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds, and the engine adds the choice index
NO_DEFAULTS: Mapping[str, float | int] = MappingProxyType({})  # a model without sampling defaults


def _valid_unicode(text: str) -> str:
    """JSON's \\ud800 escapes give Python strings with lone surrogates, which no tokenizer (and no
    UTF-8 response that echoes them) can encode: refuse them where they arrive, naming the field."""
    try:
        text.encode()
    except UnicodeEncodeError as exc:
        message = "invalid Unicode: a lone surrogate at position {position}"
        raise PydanticCustomError("invalid_unicode", message, {"position": exc.start}) from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]  # every string a request carries


# Scheduling fields every API's request takes (their other fields are each API's own):
# vLLM's `priority`, lower first under --scheduling-policy priority, refused other than 0 under
# fcfs (by the engine, yaie/engine/request.py); and yaie's `timeout`, seconds after which the
# request ends, finished or not, with finish_reason "timeout".
Timeout = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


# -- requests ---------------------------------------------------------------------------------


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class ToolCallFunction(OpenAIModel):
    name: Text
    arguments: Text  # JSON text


class ToolCallIn(OpenAIModel):
    """A call the assistant made, as a later request sends it back."""

    id: Text
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None  # None only for an assistant turn that made calls
    tool_calls: list[ToolCallIn] | None = None  # assistant turns only
    tool_call_id: Text | None = None  # tool turns: the call this is the result of

    def check(self, index: int) -> None:
        """What the types cannot say: which roles may leave out content or carry tool fields."""
        def bad(field: str, message: str) -> InvalidRequestError:
            param = f"messages[{index}].{field}"
            return InvalidRequestError(f"{param}: {message}", param)

        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise bad("content", "missing required parameter")
        if self.tool_calls and self.role != "assistant":
            raise bad("tool_calls", "only assistant messages make calls")
        if self.role == "tool" and self.tool_call_id is None:
            raise bad("tool_call_id", "missing required parameter")

    @property
    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: a role they know, plain-text content, and
        tool calls with their arguments as objects (templates write them out with tojson)."""
        role = "system" if self.role == "developer" else self.role
        message: dict[str, Any] = {"role": role, "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.function.name,
                        "arguments": _json_or_text(call.function.arguments),
                    },
                }
                for call in self.tool_calls
            ]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: Text
    description: Text | None = None
    # "schema" would shadow a BaseModel method, hence the alias.
    schema_: dict[Text, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIModel):
    """vLLM's `structured_outputs` extra: one of these."""

    json_: dict[Text, Any] | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None
    json_object: bool | None = None


class FunctionDefinition(OpenAIModel):
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: Text


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class SamplingRequest(OpenAIModel):
    """What chat and text completions share. None means "the default", as if left out."""

    model: Text | None = None  # None: the served model (there is only one), as vLLM and llama.cpp
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = None  # None: until the context is full
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None  # accepted and ignored
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    priority: int | None = None  # None: 0; see Timeout, above
    # yaie's: None takes the server's --request-timeout (if any)
    timeout: Timeout | None = None
    # vLLM's: the prompt shares the prefix cache only with the same tenant's requests that send the
    # same salt (it always does with no other tenant's), e.g. to keep a proxy's users apart.
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _renames(self) -> dict[str, str]:
        """Fields that SamplingParams and the engine name differently from this request."""
        return {STRUCTURED_OUTPUTS: self._structured_source()}

    def _structured_source(self) -> str:
        """The field the request's structured outputs come from, for errors."""
        return "response_format" if self.response_format is not None else STRUCTURED_OUTPUTS

    def _structured_outputs(self) -> StructuredOutputs | None:
        """The constraint of `response_format` or of vLLM's `structured_outputs`."""
        extra, response_format = self.structured_outputs, self.response_format
        if extra is not None and response_format is not None and response_format.type != "text":
            raise _unsupported("response_format", "cannot be combined with structured_outputs")
        if extra is not None:
            return StructuredOutputs(
                json=extra.json_, regex=extra.regex, choice=extra.choice, grammar=extra.grammar,
                json_object=bool(extra.json_object),
            )  # fmt: skip
        if response_format is None or response_format.type == "text":
            return None
        if response_format.type == "json_object":
            return StructuredOutputs(json_object=True)
        if response_format.json_schema is None or response_format.json_schema.schema_ is None:
            raise InvalidRequestError(
                "response_format: json_schema.schema is required for type json_schema", "response_format"
            )
        return StructuredOutputs(json=response_format.json_schema.schema_)

    def translate_error(self, exc: InvalidRequestError) -> InvalidRequestError:
        """`exc` (from SamplingParams or the engine) naming this request's field instead."""
        ours = self._renames().get(exc.param or "")
        if exc.param is None or ours is None or ours == exc.param:
            return exc
        return InvalidRequestError(exc.message.replace(exc.param, ours, 1), ours)

    def _sampling_params(
        self,
        defaults: Mapping[str, float | int],
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputs | None = None,
        tool_call_spans: ToolCallSpans | None = None,
    ) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options: only allowed when stream is true", "stream_options")
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "stop": self.stop,
            "stop_token_ids": self.stop_token_ids,
        }
        # A field left out takes `defaults`' value, or else SamplingParams' default.
        given = {name: defaults.get(name) if value is None else value for name, value in given.items()}
        try:
            return SamplingParams(
                structured_outputs=structured_outputs or self._structured_outputs(),
                tool_call_spans=tool_call_spans,
                n=self.n,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                logit_bias=_token_bias(self.logit_bias or {}),
                ignore_eos=self.ignore_eos,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                **{name: value for name, value in given.items() if value is not None},
            )
        except InvalidRequestError as exc:
            raise self.translate_error(exc) from exc


def _token_bias(logit_bias: dict[str, float]) -> dict[int, float]:
    """OpenAI sends logit_bias keyed by token ids written as strings. Whether an id is inside the
    vocabulary is the engine's check, the one place that knows the vocabulary."""
    bias = {}
    for key, value in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError as exc:
            message = f"logit_bias: keys must be token ids, got {key!r}"
            raise InvalidRequestError(message, "logit_bias") from exc
        bias[token_id] = value
    return bias


def _unsupported(param: str, detail: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {detail}", param)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens; wins over it
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: a required call is one call
    # vLLM's: more variables for the chat template, e.g. {"enable_thinking": false} for Qwen3's
    chat_template_kwargs: dict[Text, Any] | None = None

    def to_sampling_params(
        self, tool_format: ToolFormat = HERMES, defaults: Mapping[str, float | int] = NO_DEFAULTS
    ) -> SamplingParams:
        """`tool_format` is the model's (yaie/structured/tool_formats.py): the format a required
        call is constrained to, and that of the calls the stop rules leave whole in free text.
        `defaults`: the model's, for sampling fields the request leaves out."""
        for index, message in enumerate(self.messages):
            message.check(index)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs: requires logprobs to be true", "top_logprobs")
        try:
            structured_outputs = self._tool_call_grammar(tool_format) or self._structured_outputs()
        except InvalidRequestError as exc:
            raise self.translate_error(exc) from exc
        return self._sampling_params(
            defaults,
            max_tokens=self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None,
            structured_outputs=structured_outputs,
            # Calls the model may write in its free text: the stop rules leave them whole.
            tool_call_spans=(
                tool_format.call_spans(self.tool_names)
                if self.calls_tools and structured_outputs is None
                else None
            ),
        )

    @property
    def tool_definitions(self) -> list[dict[str, Any]] | None:
        """The tools to show the model: none with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def tool_names(self) -> list[str]:
        """The names of the tools shown to the model (none with tool_choice "none")."""
        return [tool["function"]["name"] for tool in self.tool_definitions or []]

    @property
    def calls_tools(self) -> bool:
        """Whether the output is parsed for tool calls."""
        return self.tool_definitions is not None

    def _tool_call_grammar(self, tool_format: ToolFormat) -> StructuredOutputs | None:
        """For tool_choice "required" or a named function, the grammar of a valid call."""
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return None
        tools = self.tool_definitions
        if tools is None:
            raise InvalidRequestError(f"tool_choice: {choice!r} needs tools", "tool_choice")
        name = choice.function.name if isinstance(choice, NamedToolChoice) else None
        if name is not None and all(tool["function"]["name"] != name for tool in tools):
            raise InvalidRequestError(f"tool_choice: no tool is named {name!r}", "tool_choice")
        constrained = self.response_format is not None and self.response_format.type != "text"
        if constrained or self.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice: a required call cannot be combined with response_format or structured_outputs",
                "tool_choice",
            )
        return tool_format.call_grammar(tools, name)

    def _structured_source(self) -> str:
        return "tools" if self.tool_choice not in (None, "none", "auto") else super()._structured_source()

    def _renames(self) -> dict[str, str]:
        max_tokens = "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"
        return {**super()._renames(), "max_tokens": max_tokens, "logprobs": "top_logprobs"}

    def template_messages(self) -> list[dict[str, Any]]:
        return [message.to_template() for message in self.messages]


class CompletionRequest(SamplingRequest):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: Text | None = None
    best_of: int | None = None

    def to_sampling_params(self, defaults: Mapping[str, float | int] = NO_DEFAULTS) -> SamplingParams:
        """`defaults`: the model's, for sampling fields the request leaves out."""
        if self.suffix is not None:
            raise _unsupported("suffix", "is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise _unsupported("best_of", "only best_of equal to n is supported")
        # Echoing the prompt with logprobs needs the prompt's logprobs too.
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(defaults, self.max_tokens, self.logprobs, prompt_logprobs)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: OpenAI accepts one prompt or a batch, as text or token ids."""
        prompt = self.prompt
        if not prompt:
            raise InvalidRequestError("prompt: must not be empty", "prompt")
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)


class TokenizeRequest(OpenAIModel):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    chat_template_kwargs: dict[Text, Any] | None = None  # with messages, as in a chat request


class DetokenizeRequest(OpenAIModel):
    model: Text | None = None
    tokens: list[int]


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one embeddings request


class EmbeddingRequest(OpenAIModel):
    """/v1/embeddings: one vector per input, from the served model's final hidden states."""

    input: Text | list[Text] | list[int] | list[list[int]]
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: Text | None = None
    normalize: bool = True  # vLLM's extra field: False returns the vectors as pooled

    def prompts(self) -> list[str | list[int]]:
        """One entry per input: a text, a list of texts, token ids, or a list of token id lists."""
        raw = self.input
        entries: list[str | list[int]]
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):  # one text, or one list of ids
            entries = [raw]
        else:
            entries = list(cast("list[str] | list[list[int]]", raw))
        if not entries:
            raise InvalidRequestError("input: must not be empty", "input")
        if len(entries) > MAX_EMBEDDING_INPUTS:
            raise InvalidRequestError(
                f"input: at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(entries)}", "input"
            )
        for i, entry in enumerate(entries):
            if not entry:
                raise InvalidRequestError(
                    f"{_input_name(i, len(entries))}: must not be empty", _input_name(i, len(entries))
                )
        return entries

    def check_dimensions(self, size: int) -> None:
        """A decoder's hidden state is not trained to be cut short (no Matryoshka training), so
        `dimensions` is refused unless it asks for the size the vectors have anyway."""
        if self.dimensions is not None and self.dimensions != size:
            raise InvalidRequestError(
                f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened; "
                f"leave dimensions out or set it to {size}",
                "dimensions",
            )


def _input_name(index: int, count: int) -> str:
    return "input" if count == 1 else f"input[{index}]"


# -- responses --------------------------------------------------------------------------------


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None when the turn is only tool calls
    # vLLM's: the text the model thought in before answering, with a --reasoning-parser
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


# vLLM's `stop_reason` on every choice: the stop string or stop token id that ended it, or null
# (EOS, a completed grammar, max_tokens...). A stream sends it with the choice's finish_reason.
StopReason = int | str | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: StopReason = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatChunkChoice(BaseModel):
    index: int
    # {"role": ...} first, then {"content": ...} (or {"reasoning_content": ...}, the reasoning
    # before it) or {"tool_calls": [...]}, and {} with finish_reason.
    # A tool call comes as {"index", "id", "type", "function": {"name", "arguments": ""}}, then
    # {"index", "function": {"arguments": ...}} with its arguments.
    delta: dict[str, Any]
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: StopReason = None


class CompletionResponse(BaseModel):
    """A whole text completion, or (streaming) one chunk of it: OpenAI uses one shape for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "yaie"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a string: base64 of the little-endian float32 values


def encode_embedding(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as `encoding_format` asks: the floats, or base64 of their little-endian float32
    bytes (OpenAI's "base64", which the openai client decodes with numpy's float32)."""
    if encoding_format == "float":
        return list(vector)
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# -- logprobs ---------------------------------------------------------------------------------

Decode = Callable[[int], str]  # one token id to its text
MIN_LOGPROB = -9999.0  # JSON has no -inf, which tokens masked out by top_k/top_p get


def _finite(logprob: float) -> float:
    return logprob if logprob > MIN_LOGPROB else MIN_LOGPROB  # NaN, too, becomes the minimum


def _top(token_id: int, logprob: float, decode: Decode) -> TopLogprob:
    token = decode(token_id)
    return TopLogprob(token=token, logprob=_finite(logprob), bytes=list(token.encode()))


def chat_logprobs(logprobs: Sequence[TokenLogprob], decode: Decode) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                **_top(lp.token_id, lp.logprob, decode).model_dump(),
                top_logprobs=[_top(token_id, logprob, decode) for token_id, logprob in lp.top],
            )
            for lp in logprobs
        ]
    )


def completion_logprobs(
    tokens: Sequence[tuple[int, TokenLogprob | None]], decode: Decode, text_offset: int
) -> CompletionLogprobs:
    """Legacy completions' columns. `tokens` pairs each token id with its logprob (None for a
    prompt's first token, which nothing predicts); offsets count from `text_offset`."""
    result = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for token_id, lp in tokens:
        token = decode(token_id)
        result.tokens.append(token)
        result.token_logprobs.append(None if lp is None else _finite(lp.logprob))
        result.top_logprobs.append(
            None if lp is None else {decode(t): _finite(logprob) for t, logprob in lp.top}
        )
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


# -- validation errors ------------------------------------------------------------------------

def field_names(models: Sequence[type[BaseModel]]) -> frozenset[str]:
    """The names (as the JSON spells them) of the fields of request models, for error paths."""
    return frozenset(field.alias or name for model in models for name, field in model.model_fields.items())


_REQUESTS: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    ChatMessage,
    TextPart,
    StreamOptions,
    ResponseFormat,
    JsonSchemaFormat,
    StructuredOutputsRequest,
    ToolCallIn,
    ToolCallFunction,
    Tool,
    FunctionDefinition,
    NamedToolChoice,
    NamedFunction,
)


_FIELD_NAMES = field_names(_REQUESTS)


def _param_path(loc: Sequence[int | str], names: frozenset[str]) -> str | None:
    """`messages[0].content` from pydantic's ("messages", 0, "content"). Other strings in a
    location name union branches ("list[int]") or dict keys, which are not part of the path."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part in names:
            path += f".{part}" if path else part
    return path or None


def describe_validation_error(
    errors: Sequence[ErrorDetails], names: frozenset[str] = _FIELD_NAMES
) -> InvalidRequestError:
    """One InvalidRequestError for pydantic's (or FastAPI's) errors about a request body;
    `names`: the request models' field names (field_names), which a field's path is made of."""
    # Of a union's failed branches, the one that got furthest is the most telling.
    error = max(errors, key=lambda e: len(e["loc"]))
    loc = error["loc"][1:] if error["loc"][:1] == ("body",) else error["loc"]  # FastAPI's prefix
    if error["type"] == "json_invalid":
        detail = error.get("ctx", {}).get("error", error["msg"])
        return InvalidRequestError(f"the body is not valid JSON: {detail}")
    param = _param_path(loc, names)
    if param is None:
        return InvalidRequestError("the body must be a JSON object")
    if error["type"] == "missing":
        return InvalidRequestError(f"{param}: missing required parameter", param)
    return InvalidRequestError(f"{param}: {error['msg']}", param)
