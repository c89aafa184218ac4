"""Anthropic's Messages API (`/v1/messages`): its request, response and stream event shapes, and
the request's mapping onto a chat completion request.

The mapping is the whole of the request's meaning here: a Messages request becomes the
ChatCompletionRequest that says the same (system turn first, `tool_use` blocks as the assistant's
tool calls, `tool_result` blocks as tool turns, `tool_choice` "any" as "required"), so the prompt,
the SamplingParams and a required call's grammar come from the one chat path (protocol.py).

Content the served model cannot read (images, documents) and server-side tools are refused, as
is a final assistant turn (Anthropic's "prefill"): the chat template always opens a new turn.
`thinking` becomes the template's `enable_thinking` (off unless enabled, as Anthropic's models
think only when asked); thinking blocks sent back in the history are dropped, as the thinking
models' own templates drop earlier turns' reasoning.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from yaie.errors import InvalidRequestError
from yaie.sampling_params import SamplingParams
from yaie.server import protocol as p
from yaie.structured.tool_formats import HERMES, ToolFormat


class AnthropicModel(BaseModel):
    # As protocol.OpenAIModel: unknown fields (cache_control, citations, ...) are ignored, known
    # ones are not coerced.
    model_config = ConfigDict(extra="ignore", strict=True)


# -- requests ---------------------------------------------------------------------------------


class TextBlock(AnthropicModel):
    type: Literal["text"]
    text: p.Text


class ToolUseBlock(AnthropicModel):
    """A call the assistant made, as a later request sends it back."""

    type: Literal["tool_use"]
    id: p.Text
    name: p.Text
    input: dict[p.Text, Any]


class ToolResultBlock(AnthropicModel):
    type: Literal["tool_result"]
    tool_use_id: p.Text
    content: p.Text | list[TextBlock] = ""
    is_error: bool = False

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


class ThinkingBlock(AnthropicModel):
    """An earlier answer's thinking, as a client sends it back: not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]


class UnreadableBlock(AnthropicModel):
    """Content this text-only server cannot pass to its model: refused by name."""

    type: Literal["image", "document", "search_result"]


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnreadableBlock, Field(discriminator="type")
]


class Message(AnthropicModel):
    role: Literal["user", "assistant"]
    content: p.Text | list[ContentBlock]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | UnreadableBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


class Tool(AnthropicModel):
    # A client tool has no type (or "custom"); Anthropic's server tools (web search, ...) do.
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: p.Text | None = None
    input_schema: dict[p.Text, Any]


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: p.Text | None = None  # type "tool" only
    disable_parallel_tool_use: bool | None = None  # accepted: a required call is one call


class Metadata(AnthropicModel):
    user_id: p.Text | None = None  # accepted and ignored


class Thinking(AnthropicModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)  # accepted: max_tokens bounds the whole answer


class CountTokensRequest(AnthropicModel):
    """What a prompt is made of: count_tokens' whole body, and the start of a Messages request."""

    model: p.Text | None = None  # None: the served model, as the OpenAI routes
    system: p.Text | list[TextBlock] | None = None
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @property
    def thinks(self) -> bool:
        """Whether the request asks the model to think (and to see its thinking)."""
        return self.thinking is not None and self.thinking.type == "enabled"

    def chat_request(self, **sampling: Any) -> p.ChatCompletionRequest:
        """The chat completion request that says the same, with `sampling`'s fields."""
        messages = [] if self.system is None else [p.ChatMessage(role="system", content=_text(self.system))]
        for index, message in enumerate(self.messages):
            messages += _chat_messages(message, index, last=index == len(self.messages) - 1)
        tools = None
        if self.tools is not None:
            tools = [
                p.Tool(
                    type="function",
                    function=p.FunctionDefinition(
                        name=tool.name, description=tool.description, parameters=tool.input_schema
                    ),
                )
                for tool in self.tools
            ]
        return p.ChatCompletionRequest(
            model=self.model, messages=messages, tools=tools, tool_choice=self._tool_choice(),
            chat_template_kwargs={"enable_thinking": self.thinks}, **sampling,
        )  # fmt: skip

    def _tool_choice(self) -> Literal["none", "auto", "required"] | p.NamedToolChoice | None:
        choice = self.tool_choice
        if choice is None:
            return None
        if choice.type == "tool":
            if choice.name is None:
                raise InvalidRequestError("tool_choice.name: required for type 'tool'", "tool_choice.name")
            return p.NamedToolChoice(type="function", function=p.NamedFunction(name=choice.name))
        if choice.name is not None:
            raise InvalidRequestError(
                f"tool_choice.name: only for type 'tool', not {choice.type!r}", "tool_choice.name"
            )
        return "required" if choice.type == "any" else choice.type


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[p.Text] | None = None
    stream: bool = False
    metadata: Metadata | None = None
    # yaie's extensions, as on OpenAI's requests (protocol.Timeout)
    priority: int | None = None  # None: 0
    timeout: p.Timeout | None = None

    def to_chat(self) -> p.ChatCompletionRequest:
        return self.chat_request(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences,
            priority=self.priority,
            timeout=self.timeout,
        )

    def to_sampling_params(
        self, chat: p.ChatCompletionRequest, tool_format: ToolFormat = HERMES,
        defaults: Mapping[str, float | int] = p.NO_DEFAULTS,
    ) -> SamplingParams:  # fmt: skip
        """`chat`'s SamplingParams (`chat` is `to_chat()`), its errors naming this request's fields."""
        try:
            return chat.to_sampling_params(tool_format, defaults)
        except InvalidRequestError as exc:
            raise translate_error(exc) from exc


def translate_error(exc: InvalidRequestError) -> InvalidRequestError:
    """`exc`, about the chat request a Messages request became, naming the Messages field."""
    ours = {"stop": "stop_sequences", "tools": "tool_choice"}.get(exc.param or "")
    if exc.param is None or ours is None:
        return exc
    return InvalidRequestError(exc.message.replace(exc.param, ours, 1), ours)


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "\n".join(block.text for block in content)


def _chat_messages(message: Message, index: int, last: bool) -> list[p.ChatMessage]:
    """One Anthropic turn as chat messages: tool results become tool turns, in their place
    among the turn's text; an assistant's tool_use blocks become its tool calls."""

    def bad(field: str, detail: str) -> InvalidRequestError:
        param = f"messages[{index}].{field}"
        return InvalidRequestError(f"{param}: {detail}", param)

    if last and message.role == "assistant":
        raise bad("role", "the last message must be the user's (a final assistant turn is not supported)")
    blocks = message.blocks()
    for i, block in enumerate(blocks):
        if isinstance(block, UnreadableBlock):
            raise bad(
                f"content[{i}].type", f"{block.type!r} blocks are not supported by this text-only server"
            )
        if isinstance(block, ToolUseBlock) and message.role != "assistant":
            raise bad(f"content[{i}].type", "only assistant messages make tool_use calls")
        if isinstance(block, ToolResultBlock) and message.role != "user":
            raise bad(f"content[{i}].type", "tool_result blocks belong in user messages")
    if message.role == "assistant":
        text = "\n".join(block.text for block in blocks if isinstance(block, TextBlock))
        calls = [
            p.ToolCallIn(
                id=block.id,
                function=p.ToolCallFunction(
                    name=block.name, arguments=json.dumps(block.input, ensure_ascii=False)
                ),
            )
            for block in blocks
            if isinstance(block, ToolUseBlock)
        ]
        return [
            p.ChatMessage(
                role="assistant", content=text if text or not calls else None, tool_calls=calls or None
            )
        ]
    turns: list[p.ChatMessage] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if texts:
                turns.append(p.ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            result = f"Error: {block.text}" if block.is_error else block.text
            turns.append(p.ChatMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
        elif isinstance(block, TextBlock):
            texts.append(block.text)
    if texts or not turns:
        turns.append(p.ChatMessage(role="user", content="\n".join(texts)))
    return turns


R = TypeVar("R", bound="CountTokensRequest")

# Every model a request body is made of, for naming a bad field (p.describe_validation_error).
_REQUESTS: tuple[type[BaseModel], ...] = (
    MessagesRequest, TextBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, UnreadableBlock, Message,
    Tool, ToolChoice, Metadata, Thinking,
)  # fmt: skip
FIELD_NAMES = p.field_names(_REQUESTS)


def parse(model: type[R], body: bytes) -> R:
    """The request in `body`, or an InvalidRequestError naming its first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise p.describe_validation_error(exc.errors(), FIELD_NAMES) from exc


# -- responses --------------------------------------------------------------------------------


class TextContent(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ToolUseContent(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class ThinkingContent(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's proof of its own thinking; this server signs nothing


Content = ThinkingContent | TextContent | ToolUseContent


class Usage(BaseModel):
    # As Anthropic counts: input_tokens are the prompt's tokens not read from the prefix cache.
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0

    @classmethod
    def of(cls, usage: p.Usage) -> Usage:
        cached = usage.prompt_tokens_details.cached_tokens
        return cls(
            input_tokens=usage.prompt_tokens - cached,
            output_tokens=usage.completion_tokens,
            cache_read_input_tokens=cached,
        )


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[Content]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: Usage


class CountTokensResponse(BaseModel):
    input_tokens: int


# -- stream events: each sent as `event: <type>` with the event as its data -------------------


class MessageStart(BaseModel):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse  # no content yet, no stop_reason


class ContentBlockStart(BaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Content  # empty: text "" or input {}


class Ping(BaseModel):
    type: Literal["ping"] = "ping"


class ContentBlockDelta(BaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    # {"type": "text_delta", "text": ...}, {"type": "thinking_delta", "thinking": ...} or
    # {"type": "input_json_delta", "partial_json": ...}
    delta: dict[str, str]


class ContentBlockStop(BaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDeltaUsage(BaseModel):
    output_tokens: int


class MessageDelta(BaseModel):
    type: Literal["message_delta"] = "message_delta"
    delta: dict[str, str | None]  # stop_reason, stop_sequence
    usage: MessageDeltaUsage


class MessageStop(BaseModel):
    type: Literal["message_stop"] = "message_stop"


StreamEvent = (
    MessageStart
    | ContentBlockStart
    | Ping
    | ContentBlockDelta
    | ContentBlockStop
    | MessageDelta
    | MessageStop
)


# -- errors -----------------------------------------------------------------------------------

# Anthropic's error types by HTTP status; any other 4xx is a bad request, any other 5xx the API's.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's error body."""
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
