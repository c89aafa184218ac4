"""OpenAI's Responses API (/v1/responses): its request and response shapes, and the request's
mapping onto a chat completion request.

A Responses request is a chat request in other words: its `input` (a string, or a list of
messages, `function_call` items the model made and `function_call_output` items that answer
them) after its `instructions` and after the conversation of the response it continues
(`previous_response_id`) is the chat's messages; its flat function tools, `tool_choice`,
`text.format` and `max_output_tokens` are the chat's tools, tool_choice, response_format and
max_tokens. So it is turned into a `ChatCompletionRequest` (`ResponsesChat`, which names the
Responses fields in its errors) and goes the chat's way to a prompt, SamplingParams and a
tool-call grammar.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError

from yaie.errors import InvalidRequestError
from yaie.server import protocol as p
from yaie.server.protocol import OpenAIModel, Text

# -- requests ---------------------------------------------------------------------------------


class InputTextPart(OpenAIModel):
    # An assistant turn sent back carries the output_text parts the response gave.
    type: Literal["input_text", "output_text"]
    text: Text


class InputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[InputTextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(OpenAIModel):
    """A call the model made, sent back to continue the conversation after it."""

    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: Text  # JSON text


class FunctionCallOutputItem(OpenAIModel):
    """The result of a call, for the model to go on from."""

    type: Literal["function_call_output"]
    call_id: Text
    output: Text | list[InputTextPart]

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_type(item: Any) -> str:
    """An item without a type is a message ({"role", "content"}), as OpenAI reads it."""
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return str(getattr(item, "type", "message"))


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(OpenAIModel):
    """A function tool, flat: {"type": "function", "name", "description", "parameters", "strict"}."""

    type: Literal["function"]
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[Text, Any] | None = None
    strict: bool | None = None

    def to_chat(self) -> p.Tool:
        function = p.FunctionDefinition(
            name=self.name, description=self.description, parameters=self.parameters, strict=self.strict
        )
        return p.Tool(type="function", function=function)


class NamedFunctionChoice(OpenAIModel):
    type: Literal["function"]
    name: Text


class TextFormatText(OpenAIModel):
    type: Literal["text"]


class TextFormatJsonObject(OpenAIModel):
    type: Literal["json_object"]


class TextFormatJsonSchema(OpenAIModel):
    type: Literal["json_schema"]
    name: Text
    # "schema" would shadow a BaseModel method, hence the alias.
    schema_: dict[Text, Any] = Field(alias="schema")
    description: Text | None = None
    strict: bool | None = None


TextFormat = Annotated[
    TextFormatText | TextFormatJsonObject | TextFormatJsonSchema, Field(discriminator="type")
]


class TextConfig(OpenAIModel):
    format: TextFormat = TextFormatText(type="text")


class ResponsesRequest(OpenAIModel):
    model: Text | None = None  # None: the served model
    input: Text | list[InputItem] | None = None  # None only to continue a previous response
    instructions: Text | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted: a required call is one call
    text: TextConfig | None = None
    store: bool = True
    previous_response_id: Text | None = None
    metadata: dict[Text, Text] | None = None
    user: Text | None = None  # accepted and ignored
    # vLLM's and yaie's extensions, as on chat completions (protocol.Timeout)
    priority: int | None = None  # None: 0
    timeout: p.Timeout | None = None

    @classmethod
    def parse(cls, body: bytes) -> ResponsesRequest:
        """The request in `body`, or a 400 naming the field that is wrong."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            raise p.describe_validation_error(exc.errors(), FIELD_NAMES) from None

    def input_messages(self) -> list[p.ChatMessage]:
        """`input` as chat messages: consecutive function calls (and the assistant text before
        them) are one assistant turn, as chat templates expect them."""
        if self.input is None:
            return []
        if isinstance(self.input, str):
            return [p.ChatMessage(role="user", content=self.input)]
        messages: list[p.ChatMessage] = []
        for item in self.input:
            if isinstance(item, InputMessage):
                messages.append(p.ChatMessage(role=item.role, content=item.text))
            elif isinstance(item, FunctionCallItem):
                call = p.ToolCallIn(
                    id=item.call_id, function=p.ToolCallFunction(name=item.name, arguments=item.arguments)
                )
                last = messages[-1] if messages else None
                if last is not None and last.role == "assistant":
                    last.tool_calls = [*(last.tool_calls or []), call]
                else:
                    messages.append(p.ChatMessage(role="assistant", content=None, tool_calls=[call]))
            else:
                messages.append(p.ChatMessage(role="tool", content=item.text, tool_call_id=item.call_id))
        return messages

    def to_chat(self, history: Sequence[p.ChatMessage]) -> ResponsesChat:
        """The chat request this one is: `instructions` first (they are not carried over from a
        previous response, as OpenAI), then `history` (the previous response's conversation),
        then `input`."""
        messages = list(history) + self.input_messages()
        if not messages:
            raise InvalidRequestError("input: missing required parameter", "input")
        if self.instructions is not None:
            messages.insert(0, p.ChatMessage(role="system", content=self.instructions))
        tool_choice: Literal["none", "auto", "required"] | p.NamedToolChoice | None
        if isinstance(self.tool_choice, NamedFunctionChoice):
            tool_choice = p.NamedToolChoice(
                type="function", function=p.NamedFunction(name=self.tool_choice.name)
            )
        else:
            tool_choice = self.tool_choice
        return ResponsesChat(
            messages=messages,
            n=1,
            seed=None,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            tools=[tool.to_chat() for tool in self.tools] if self.tools else None,
            tool_choice=tool_choice,
            response_format=self._response_format(),
            priority=self.priority,
            timeout=self.timeout,
        )

    def _response_format(self) -> p.ResponseFormat | None:
        text_format = self.text.format if self.text is not None else None
        if text_format is None or isinstance(text_format, TextFormatText):
            return None
        if isinstance(text_format, TextFormatJsonObject):
            return p.ResponseFormat(type="json_object")
        json_schema = p.JsonSchemaFormat(
            name=text_format.name,
            description=text_format.description,
            schema=text_format.schema_,
            strict=text_format.strict,
        )
        return p.ResponseFormat(type="json_schema", json_schema=json_schema)

    def echo(self) -> dict[str, Any]:
        """The request's fields a Response repeats."""
        tool_choice = self.tool_choice
        return {
            "instructions": self.instructions,
            "max_output_tokens": self.max_output_tokens,
            "metadata": self.metadata or {},
            "parallel_tool_calls": True if self.parallel_tool_calls is None else self.parallel_tool_calls,
            "previous_response_id": self.previous_response_id,
            "store": self.store,
            "text": (self.text or TextConfig()).model_dump(by_alias=True, exclude_none=True),
            "tool_choice": (
                tool_choice.model_dump() if isinstance(tool_choice, BaseModel) else tool_choice or "auto"
            ),
            "tools": [tool.model_dump(exclude_none=True) for tool in self.tools or []],
            "user": self.user,
        }


class ResponsesChat(p.ChatCompletionRequest):
    """The chat request a Responses request is, whose errors name the Responses fields."""

    def _structured_source(self) -> str:
        return "tools" if self.tool_choice not in (None, "none", "auto") else "text.format"

    def _renames(self) -> dict[str, str]:
        return {
            **super()._renames(),
            "max_tokens": "max_output_tokens",
            "response_format": self._structured_source(),
        }


FIELD_NAMES = p.field_names(
    [
        ResponsesRequest,
        InputTextPart,
        InputMessage,
        FunctionCallItem,
        FunctionCallOutputItem,
        FunctionTool,
        NamedFunctionChoice,
        TextConfig,
        TextFormatJsonSchema,
    ]
)


# -- responses --------------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOutput(BaseModel):
    """A call the model made (named as OpenAI's `function_call` output item)."""

    id: str
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str  # JSON text


OutputItem = OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int

    @classmethod
    def of(cls, usage: p.Usage) -> ResponseUsage:
        return cls(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(),
            total_tokens=usage.total_tokens,
        )


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens", "timeout"]  # timeout: yaie's, the request's deadline passed


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    error: p.ErrorInfo | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    temperature: float | None
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    # echoed from the request (ResponsesRequest.echo)
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    store: bool
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    user: str | None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
