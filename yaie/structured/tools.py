"""OpenAI tool calling for templates that know nothing of tools, in the Hermes style (as
llama.cpp does for such templates): rendering tools into the conversation, the grammar that
makes a required call valid, and parsing calls out of the model's text.

The format. The tool definitions go into the system message (prepended to the first one, or
as a new one):

    You are a function calling AI model. You are provided with function signatures within
    <tools></tools> XML tags. ... <tools>
    {"type": "function", "function": {"name": ..., "description": ..., "parameters": ...}}
    </tools> ... return a json object with function name and arguments within
    <tool_call></tool_call> XML tags as follows:
    <tool_call>
    {"name": <function-name>, "arguments": <args-dict>}
    </tool_call>

An assistant turn that called tools is rendered as its content followed by one such
`<tool_call>` block per call, and a tool result (role "tool") as its content inside
`<tool_response>...</tool_response>`. Qwen's templates use the same tags, so its output parses
the same way; a call may also name its arguments "parameters", as Llama-3 writes them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from yaie.structured.backend import JSON_OPTIONS
from yaie.structured.nested_schema import Definitions
from yaie.structured.spec import StructuredOutputs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
SYSTEM_PROMPT = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available "
    "tools: <tools>\n{tools}\n</tools>\nFor each function call return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags as follows:\n"
    '<tool_call>\n{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def template_knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (Llama-3, Qwen, Mistral templates do)."""
    return chat_template is not None and "tools" in chat_template


def render_call(name: str, arguments: Any) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{call}\n{CLOSE}"


def hermes_messages(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """`messages` for a template without tool support: the tool definitions (if any) in the
    system message, calls and results in the text of their turns (see the module docstring)."""
    rendered: list[dict[str, Any]] = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            functions = [call["function"] for call in message["tool_calls"]]
            calls = [render_call(function["name"], _arguments(function)) for function in functions]
            content = "\n".join([content, *calls] if content else calls)
        elif role == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        rendered.append({"role": role, "content": content})
    if tools:
        system = SYSTEM_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": f"{rendered[0]['content']}\n\n{system}"}
        else:
            rendered.insert(0, {"role": "system", "content": system})
    return rendered


def _arguments(function: dict[str, Any]) -> Any:
    """A call's arguments as an object: OpenAI messages carry them as JSON text."""
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def call_schema(tools: Sequence[dict[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of any of `tools` (OpenAI tool definitions), its arguments
    under `arguments_key`. Each tool's parameters are nested in it, so their definitions go to
    its root, named after their tool, and their references follow (nested_schema.py)."""
    definitions = Definitions()
    calls = []
    for index, tool in enumerate(tools):
        function = tool["function"]
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        place: list[str | int] = ["anyOf", index] if len(tools) > 1 else []
        at = [*place, "properties", arguments_key]
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": function["name"]},
                    arguments_key: definitions.nest(parameters, at, function["name"]),
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    return definitions.attach(calls[0] if len(calls) == 1 else {"anyOf": calls})


def call_grammar(tools: Sequence[dict[str, Any]], name: str | None = None) -> StructuredOutputs:
    """Exactly one `<tool_call>` block whose JSON is a valid call of one of `tools` (of the one
    named `name`, if given): what tool_choice "required" or a named function makes the model
    write."""
    chosen = [tool for tool in tools if name is None or tool["function"]["name"] == name]
    schema = {**call_schema(chosen), "x-guidance": JSON_OPTIONS}
    opening, closing = json.dumps(OPEN + "\n"), json.dumps("\n" + CLOSE)  # as Lark string literals
    lark = f"start: {opening} call {closing}\ncall: %json {json.dumps(schema)}"
    return StructuredOutputs(grammar=lark)


@dataclass(frozen=True)
class ToolCall:
    index: int  # its place among the choice's calls
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def parse_call(body: str, index: int = 0) -> ToolCall | None:
    """The call in the text between <tool_call> and </tool_call>, or None if it is not one;
    `index` is its place among the choice's calls."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    arguments_text = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(index, new_call_id(), call["name"], arguments_text)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# (kind, value): ("content", text) or ("call", ToolCall)
Event = tuple[str, Any]


class ToolCallParser:
    """Splits one choice's text, fed as it streams, into content and tool calls.

    Text that may be the start of a `<tool_call>` tag is held back until it is known not to be,
    and a call is given out whole once its closing tag (or the end of the text) arrives. A block
    whose body is not a call is given out as content, tags and all.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not given out yet
        self._in_call = False
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        events: list[Event] = []
        while True:
            if self._in_call:
                end = self._pending.find(CLOSE)
                if end < 0:
                    return events
                events.append(self._call(self._pending[:end], closed=True))
                self._pending = self._pending[end + len(CLOSE) :]
                self._in_call = False
                continue
            start = self._pending.find(OPEN)
            if start >= 0:
                events += _content(self._pending[:start])
                self._pending = self._pending[start + len(OPEN) :]
                self._in_call = True
                continue
            keep = _partial_tag(self._pending)
            events += _content(self._pending[: len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep :]
            return events

    def finish(self) -> list[Event]:
        """What is left once the text is complete: a call cut short by the end, or content."""
        rest, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return [self._call(rest, closed=False)]
        return _content(rest)

    def _call(self, body: str, closed: bool) -> Event:
        call = parse_call(body, self.num_calls)
        if call is None:
            return ("content", OPEN + body + (CLOSE if closed else ""))
        self.num_calls += 1
        return ("call", call)


# Free text newly decided in a choice's text: (where its run of free text starts, start, end).
FreeText = tuple[int, int, int]


class CallSpans:
    """Which parts of one choice's text are tool calls, decided as the text grows: stop strings
    and stop tokens apply to the rest, the free text, and never inside a call (the server parses
    calls out of the text afterwards, and a cut one would be lost). Each format's subclass decides
    what a call is exactly as its parser does.

    `decided`: how much of the text is decided, call or free; `free_run`: where the free text
    that reaches `decided` starts (None when the decided text ends in a call)."""

    def __init__(self) -> None:
        self.decided = 0
        self.free_run: int | None = 0

    @property
    def in_call(self) -> bool:
        """Whether the text now goes on inside what may be a call."""
        raise NotImplementedError

    def advance(self, text: str) -> list[FreeText]:
        """Read `text` (the choice's whole text: what the last call saw, and more); the free
        text it newly decides, in order."""
        raise NotImplementedError

    def cut_floor(self, holdback: int) -> int:
        """The earliest place where a stop string found later may start (a stream shows no text
        from there on): in the free text that reaches `decided`, or after it. `holdback`: the
        longest stop string's length less one."""
        return self.decided if self.free_run is None else max(self.free_run, self.decided - holdback)

    def _free_to(self, end: int) -> list[FreeText]:
        """The text from `decided` to `end` is free."""
        if end <= self.decided:
            return []
        start, self.decided = self.decided, end
        if self.free_run is None:
            self.free_run = start
        return [(self.free_run, start, end)]

    def _call_to(self, end: int) -> None:
        """The text from `decided` to `end` is a call."""
        self.decided, self.free_run = end, None


class HermesCallSpans(CallSpans):
    """The calls of Hermes-style text: the `<tool_call>` blocks whose body is a call (as
    ToolCallParser decides, which gives any other block out as content, tags and all). A block
    is decided when it closes; until then it is undecided, as is a tail that may begin a tag."""

    def __init__(self) -> None:
        super().__init__()
        self._call_start: int | None = None  # where the open block's tag starts
        self._scan = 0  # where the next tag may start

    @property
    def in_call(self) -> bool:
        return self._call_start is not None

    def advance(self, text: str) -> list[FreeText]:
        free: list[FreeText] = []
        while True:
            if self._call_start is not None:
                close = text.find(CLOSE, self._scan)
                if close < 0:
                    self._scan = max(self._scan, len(text) - len(CLOSE) + 1)
                    return free
                end = close + len(CLOSE)
                if parse_call(text[self._call_start + len(OPEN) : close]) is None:
                    free += self._free_to(end)
                else:
                    self._call_to(end)
                self._call_start = None
                self._scan = end
                continue
            start = text.find(OPEN, self._scan)
            if start >= 0:
                free += self._free_to(start)
                self._call_start, self._scan = start, start + len(OPEN)
                continue
            self._scan = len(text) - _partial_tag(text[self._scan :])
            return free + self._free_to(self._scan)


def _content(text: str) -> list[Event]:
    return [("content", text)] if text else []


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin an opening tag."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0
