"""Ollama's API (/api/chat, /api/generate, ...): its request and response shapes, and their
mapping onto the OpenAI requests whose conversion to a prompt and SamplingParams they reuse.

As Ollama, requests ignore fields they do not know, and `options` ignores the options that have
no meaning here (num_ctx, num_thread, mirostat, ...); the ones that map are strict about their
types. The mapped options and their OpenAI names: temperature, top_p, top_k, min_p, seed (a
negative seed is Ollama's "random"), stop, num_predict -> max_tokens (a negative count is Ollama's
"no limit": the rest of the context), repeat_penalty -> repetition_penalty, presence_penalty,
frequency_penalty. `format` "json" is a JSON object, a schema is that schema. `think` is the
chat template's `enable_thinking`, and asks for the reasoning in `thinking` (from a server with a
reasoning parser: reasoning.py); Ollama's levels ("low", "medium", "high") are `true`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from yaie.errors import InvalidRequestError
from yaie.server import protocol as p
from yaie.server.protocol import Text

DEFAULT_TAG = "latest"  # Ollama names a model "name:tag", and a name alone means this tag

# Error parameters as the OpenAI requests name them -> as an Ollama request does.
PARAMS = {
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "max_tokens": "options.num_predict",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "response_format": "format",
    "structured_outputs": "format",
}


def translate_error(exc: InvalidRequestError) -> InvalidRequestError:
    """`exc`, raised about the OpenAI request made of an Ollama one, naming the Ollama field."""
    if exc.param is None:
        return exc
    head, dot, rest = exc.param.partition(".")
    ours = PARAMS.get(exc.param) or (PARAMS[head] + dot + rest if head in PARAMS else None)
    if ours is None:
        return exc
    return InvalidRequestError(exc.message.replace(exc.param, ours, 1), ours)


class OllamaModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class Options(OllamaModel):
    """The `options` that map onto our sampling; Ollama's others are accepted and ignored."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: list[Text] | Text | None = None
    num_predict: int | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def sampling_fields(self) -> dict[str, Any]:
        """The OpenAI request's fields, None where the request leaves the default."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": None if self.seed is None or self.seed < 0 else self.seed,
            "stop": self.stop,
            "max_tokens": None if self.num_predict is None or self.num_predict < 0 else self.num_predict,
            "repetition_penalty": self.repeat_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }

    @property
    def fills_context(self) -> bool:
        """num_predict -1 (or Ollama's -2, "fill the context"): as many tokens as the context holds."""
        return self.num_predict is not None and self.num_predict < 0


OpenAIRequest = TypeVar("OpenAIRequest", bound=p.SamplingRequest)
Format = Literal["", "json"] | dict[Text, Any]


class GenerationRequest(OllamaModel):
    """What /api/chat and /api/generate share."""

    model: Text
    stream: bool | None = None  # None: true, Ollama's default
    format: Format | None = None
    options: Options | None = None
    keep_alive: Text | float | None = None  # accepted: the model is always loaded
    think: bool | Text | None = None
    logprobs: bool | None = None
    # yaie's extensions, as on OpenAI's requests (protocol.Timeout); a timeout is done_reason "timeout"
    priority: int | None = None  # None: 0
    timeout: p.Timeout | None = None

    @property
    def streams(self) -> bool:
        return self.stream is not False

    @property
    def thinks(self) -> bool | None:
        """Whether the request asks the model to think; None: the model's default."""
        return None if self.think is None else self.think is not False

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        return None if self.thinks is None else {"enable_thinking": self.thinks}

    def check(self, splits_thinking: bool) -> None:
        """`splits_thinking`: whether the server has a reasoning parser, which `think` needs."""
        if self.thinks and not splits_thinking:
            message = "think: this server splits out no thinking (serve with --reasoning-parser)"
            raise InvalidRequestError(message, "think")
        if self.logprobs:
            raise InvalidRequestError("logprobs: not supported by this server's Ollama API", "logprobs")

    @property
    def fills_context(self) -> bool:
        return self.options is not None and self.options.fills_context

    def sampling_fields(self) -> dict[str, Any]:
        """The OpenAI request's sampling fields, response format and scheduling fields for this
        request."""
        fields = self.options.sampling_fields() if self.options is not None else {}
        fields.update(priority=self.priority, timeout=self.timeout)
        if self.format == "json":
            fields["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            schema = {"name": "format", "schema": self.format}
            fields["response_format"] = {"type": "json_schema", "json_schema": schema}
        return {name: value for name, value in fields.items() if value is not None}


class FunctionCallIn(OllamaModel):
    name: Text
    arguments: dict[Text, Any]  # an object, not JSON text as in OpenAI's API

    def openai(self) -> dict[str, str]:
        return {"name": self.name, "arguments": json.dumps(self.arguments)}


class ToolCallIn(OllamaModel):
    function: FunctionCallIn


class Message(OllamaModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: Text = ""
    images: list[Text] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns only
    tool_name: Text | None = None  # tool turns: the tool whose result this is
    thinking: Text | None = None  # accepted: templates are shown the content only


class ChatRequest(GenerationRequest):
    messages: list[Message] = []
    tools: list[p.Tool] | None = None
    # yaie's extension, OpenAI's field: Ollama lets the model choose ("auto"), which a small
    # model may never do; "required" or a named function makes it call (its grammar).
    tool_choice: Literal["none", "auto", "required"] | p.NamedToolChoice | None = None

    def to_openai(self) -> p.ChatCompletionRequest:
        """The chat completion request this one asks for. Ollama's calls carry no ids, so each
        gets one, and a tool turn answers the next unanswered call of the assistant turn before it."""
        messages: list[dict[str, Any]] = []
        call_ids: list[str] = []  # the last assistant turn's calls that no tool turn has answered
        for i, message in enumerate(self.messages):
            if message.images:
                param = f"messages[{i}].images"
                raise InvalidRequestError(f"{param}: the served model reads no images", param)
            turn: dict[str, Any] = {"role": message.role, "content": message.content}
            if message.tool_calls:
                call_ids = [f"call_{i}_{j}" for j in range(len(message.tool_calls))]
                turn["tool_calls"] = [
                    {"id": call_id, "type": "function", "function": call.function.openai()}
                    for call_id, call in zip(call_ids, message.tool_calls, strict=True)
                ]
            if message.role == "tool":
                turn["tool_call_id"] = call_ids.pop(0) if call_ids else f"call_{i}"
            messages.append(turn)
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "chat_template_kwargs": self.template_kwargs,
            **self.sampling_fields(),
        }  # fmt: skip
        if self.tools:
            body["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if self.tool_choice is not None:
            choice = self.tool_choice
            body["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
        return _openai(p.ChatCompletionRequest, body)


class GenerateRequest(GenerationRequest):
    prompt: Text = ""
    suffix: Text | None = None
    system: Text | None = None
    template: Text | None = None  # Ollama's Go template: its fields and `if` blocks only
    context: list[int] | None = None  # the token ids an earlier response returned, to continue it
    raw: bool = False  # the prompt as it is, through no template
    images: list[Text] | None = None

    def check(self, splits_thinking: bool) -> None:
        super().check(splits_thinking)
        if self.suffix:
            raise InvalidRequestError("suffix: fill-in-the-middle is not supported", "suffix")
        if self.images:
            raise InvalidRequestError("images: the served model reads no images", "images")
        if self.raw and (self.system is not None or self.template is not None):
            param = "system" if self.system is not None else "template"
            raise InvalidRequestError(f"{param}: a raw prompt goes through no template", param)

    def templated(self) -> str | None:
        """The prompt through `template`, or None without one (then the chat template applies)."""
        if self.template is None:
            return None
        return render_template(self.template, {"System": self.system or "", "Prompt": self.prompt})

    def to_openai(self, prompt: list[int]) -> p.CompletionRequest:
        """The completion request of the prompt's token ids."""
        return _openai(p.CompletionRequest, {"model": self.model, "prompt": prompt, **self.sampling_fields()})


def _openai(model: type[OpenAIRequest], body: dict[str, Any]) -> OpenAIRequest:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise translate_error(p.describe_validation_error(exc.errors())) from exc


class ShowRequest(OllamaModel):
    model: Text | None = None
    name: Text | None = None  # the older name of the field
    verbose: bool | None = None


class EmbedRequest(OllamaModel):
    """/api/embed: one L2-normalised vector per input, as Ollama's."""

    model: Text
    input: Text | list[Text] = []  # "" or []: nothing to embed (Ollama's way to load a model)
    truncate: bool = True  # cut an input longer than the context to fit (Ollama's default), else 400
    dimensions: int | None = None
    options: Options | None = None  # accepted: none of them applies to an embedding
    keep_alive: Text | float | None = None  # accepted: the model is always loaded

    def inputs(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return list(self.input)


class EmbeddingsRequest(OllamaModel):
    """/api/embeddings, Ollama's older endpoint: one prompt's vector, not normalised (as Ollama's)."""

    model: Text
    prompt: Text = ""  # "": nothing to embed
    options: Options | None = None
    keep_alive: Text | float | None = None


REQUESTS: tuple[type[BaseModel], ...] = (
    ChatRequest, GenerateRequest, ShowRequest, EmbedRequest, EmbeddingsRequest, Options, Message,
    ToolCallIn, FunctionCallIn, p.Tool, p.FunctionDefinition, p.NamedToolChoice, p.NamedFunction,
)  # fmt: skip
FIELD_NAMES = p.field_names(REQUESTS)


def parse(model: type[OllamaModel], body: object) -> Any:
    """`body` (parsed JSON) as a request of `model`, or an InvalidRequestError naming the field."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise p.describe_validation_error(exc.errors(), FIELD_NAMES) from exc


# -- Go templates -----------------------------------------------------------------------------

_TRIM_LEFT = re.compile(r"\s*\{\{-")
_TRIM_RIGHT = re.compile(r"-\}\}\s*")
_IF = re.compile(r"\{\{\s*if\s+\.(\w+)\s*\}\}(.*?)\{\{\s*end\s*\}\}", re.DOTALL)
_FIELD = re.compile(r"\{\{\s*\.(\w+)\s*\}\}")
_RESPONSE = re.compile(r"\{\{\s*\.Response\s*\}\}")


def render_template(template: str, values: Mapping[str, str]) -> str:
    """A Go template of Ollama's as far as a prompt's needs go: `{{ .System }}`, `{{ .Prompt }}`,
    `{{ if .X }}...{{ end }}` and the `{{-`/`-}}` trims; the text from `{{ .Response }}` on is the
    model's to write. Anything else is refused: running Go's template language is Ollama's part."""
    text = _TRIM_RIGHT.sub("}}", _TRIM_LEFT.sub("{{", template))
    text = _RESPONSE.split(text, maxsplit=1)[0]

    def field(name: str) -> str:
        if name not in values:
            raise InvalidRequestError(f"template: unknown field .{name}", "template")
        return values[name]

    text = _IF.sub(lambda m: m.group(2) if field(m.group(1)) else "", text)
    text = _FIELD.sub(lambda m: field(m.group(1)), text)
    if "{{" in text:
        raise InvalidRequestError(
            "template: only {{ .System }}, {{ .Prompt }}, {{ .Response }} and "
            "{{ if .X }}...{{ end }} are supported",
            "template",
        )
    return text


# -- responses --------------------------------------------------------------------------------


def timestamp() -> str:
    """RFC 3339 in UTC, as Ollama writes `created_at`."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FunctionCallOut(BaseModel):
    name: str
    arguments: dict[str, Any]


class ToolCallOut(BaseModel):
    function: FunctionCallOut


class MessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    thinking: str | None = None  # the reasoning before the content, when the request thinks
    tool_calls: list[ToolCallOut] | None = None


class Chunk(BaseModel):
    """One line of a stream, or (done) its last, or the whole response: Ollama uses one shape.
    Chat fills `message`, generate `response` (and `context` when done)."""

    model: str
    created_at: str
    message: MessageOut | None = None
    response: str | None = None
    thinking: str | None = None  # generate's reasoning before `response`, when the request thinks
    done: bool
    done_reason: str | None = None
    context: list[int] | None = None
    # Nanoseconds. The model is loaded before the server answers, so load_duration is 0;
    # prompt_eval_duration runs to the first generated token, eval_duration from it to the end.
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None

    def line(self) -> str:
        return self.model_dump_json(exclude_none=True) + "\n"


class EmbedResponse(BaseModel):
    model: str
    embeddings: list[list[float]]
    # Nanoseconds, as Chunk's: the model is always loaded, so load_duration is 0.
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None


class EmbeddingResponse(BaseModel):
    embedding: list[float]


class ModelDetails(BaseModel):
    parent_model: str = ""
    format: str
    family: str
    families: list[str]
    parameter_size: str | None = None
    quantization_level: str | None = None


class ModelEntry(BaseModel):
    """A model as /api/tags and /api/ps list it."""

    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    # /api/ps only
    expires_at: str | None = None
    size_vram: int | None = None
    context_length: int | None = None


class ModelList(BaseModel):
    models: list[ModelEntry]


class ShowResponse(BaseModel):
    modified_at: str
    template: str
    parameters: str
    details: ModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]


def call_arguments(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text, from the tool format's parser) as the object Ollama sends;
    text that is no JSON object is kept whole under "arguments" rather than lost."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def model_names(served: str) -> tuple[str, frozenset[str]]:
    """The served model's name as Ollama lists it ("name:tag"), and every name a request may use."""
    listed = served if ":" in served else f"{served}:{DEFAULT_TAG}"
    return listed, frozenset({served, listed})


def parameters_text(defaults: Mapping[str, float | int]) -> str:
    """The model's sampling defaults (SamplingParams' names) as Ollama's Modelfile parameter
    lines, `show`'s "parameters": one "option value" per line."""
    lines = [
        f"{PARAMS.get(name, name).removeprefix('options.'):<30} {value}" for name, value in defaults.items()
    ]
    return "\n".join(lines)
