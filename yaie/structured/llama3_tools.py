"""Tool calls in the Llama-3 style: what a Llama-3.1/3.2 chat template asks a model to write
once it has rendered `tools` itself.

Such a model answers a turn of calls with bare JSON objects, not tags:

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

The `<|python_tag|>` is optional (and is a special token, so it is usually not in the decoded
text); the arguments are named "parameters" (sometimes "arguments"); several calls are separated
by ";" or whitespace. Whether a turn is calls is decided by its first characters that are not
blank: "{" or the tag make it a turn of calls, anything else makes it content. So that an
ordinary JSON answer stays content, an object counts as a call only if its keys are exactly
"name" and "parameters" (or "arguments") and the name is one of the request's tools.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import Any

from yaie.structured.spec import StructuredOutputs
from yaie.structured.tools import CallSpans, Event, FreeText, ToolCall, call_schema, new_call_id

PYTHON_TAG = "<|python_tag|>"
HEADER = "<|start_header_id|>"  # Llama-3's turn header: how a template shows it is Llama-3's
ARGUMENT_KEYS = ("parameters", "arguments")
SEPARATORS = " \t\r\n;"


def is_llama3_template(chat_template: str) -> bool:
    """Whether a template that renders tools is a Llama-3 one (so calls come as bare JSON)."""
    return HEADER in chat_template


def call_grammar(tools: Sequence[dict[str, Any]], name: str | None = None) -> StructuredOutputs:
    """One bare JSON object that is a valid call of one of `tools` (of the one named `name`, if
    given), with its arguments as "parameters": what tool_choice "required" or a named function
    makes a Llama-3 model write."""
    chosen = [tool for tool in tools if name is None or tool["function"]["name"] == name]
    return StructuredOutputs(json=call_schema(chosen, "parameters"))


def parse_call(text: str, names: Collection[str], index: int) -> ToolCall | None:
    """The call that `text` (one JSON object) is, or None if it is not a call of one of `names`."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    keys = set(call) - {"name"}
    if len(keys) != 1 or not keys <= set(ARGUMENT_KEYS):
        return None
    [arguments] = (call[key] for key in keys)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(index, new_call_id(), call["name"], json.dumps(arguments, ensure_ascii=False))


class Llama3ToolCallParser:
    """Splits one choice's text, fed as it streams, into content and Llama-3 tool calls.

    The start of the text is held back until its first characters that are not blank decide
    what the turn is (see the module docstring). Content is then given out as it comes; in a
    turn of calls, each object is given out whole once its closing brace arrives. An object that
    is not a call, and everything after it, is content; so is an object cut short by the end.
    """

    def __init__(self, names: Collection[str]) -> None:
        self._names = frozenset(names)
        self._pending = ""  # text not given out yet
        self._mode = "start"  # "start" (undecided), "calls" or "content"
        self.num_calls = 0

    def feed(self, text: str) -> list[Event]:
        self._pending += text
        if self._mode == "start":
            head = self._pending.lstrip()
            if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                return []  # blank, or perhaps the tag: not decided yet
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self._mode, self._pending = "calls", head.removeprefix(PYTHON_TAG)
            else:
                self._mode = "content"
        if self._mode == "content":
            return self._give_out()
        return self._calls()

    def finish(self) -> list[Event]:
        """What is left once the text is complete: content, if anything."""
        return self._give_out()

    def _calls(self) -> list[Event]:
        events: list[Event] = []
        while True:
            self._pending = self._pending.lstrip(SEPARATORS)
            if not self._pending:
                return events
            if self._pending[0] != "{":
                return events + self._rest_is_content()
            end = _object_end(self._pending)
            if end is None:
                return events  # the object goes on in the text still to come
            call = parse_call(self._pending[:end], self._names, self.num_calls)
            if call is None:
                return events + self._rest_is_content()
            events.append(("call", call))
            self.num_calls += 1
            self._pending = self._pending[end:]

    def _rest_is_content(self) -> list[Event]:
        self._mode = "content"
        return self._give_out()

    def _give_out(self) -> list[Event]:
        rest, self._pending = self._pending, ""
        return [("content", rest)] if rest else []


class Llama3CallSpans(CallSpans):
    """The calls of a Llama-3 turn, as Llama3ToolCallParser decides: in a turn of calls, the
    <|python_tag|> and each object that is a call of one of `names`; the blanks and separators
    around them, and everything from the first object that is not a call on, are free. An
    object is decided when it closes."""

    def __init__(self, names: Collection[str]) -> None:
        super().__init__()
        self._names = frozenset(names)
        self._mode = "start"  # "start" (undecided), "calls" or "content"
        self._in_object = False

    @property
    def in_call(self) -> bool:
        return self._in_object

    def advance(self, text: str) -> list[FreeText]:
        free: list[FreeText] = []
        while True:
            if self._mode == "content":
                return free + self._free_to(len(text))
            # The blanks (and, between calls, the separators) ahead are free whatever follows.
            rest = text[self.decided :]
            head = rest.lstrip() if self._mode == "start" else rest.lstrip(SEPARATORS)
            free += self._free_to(len(text) - len(head))
            if self._mode == "start":
                if not head or (PYTHON_TAG.startswith(head) and head != PYTHON_TAG):
                    return free  # perhaps the tag: not decided yet
                if head.startswith(PYTHON_TAG):
                    self._call_to(self.decided + len(PYTHON_TAG))
                self._mode = "calls" if head.startswith((PYTHON_TAG, "{")) else "content"
                continue
            if not head:
                return free
            if head[0] != "{":
                self._mode = "content"
                continue
            end = _object_end(head)
            self._in_object = end is None
            if end is None:
                return free  # the object goes on in the text still to come
            if parse_call(head[:end], self._names, 0) is None:
                self._mode = "content"
                continue
            self._call_to(self.decided + end)


def _object_end(text: str) -> int | None:
    """Where the JSON object that `text` starts with ends (the index after its closing brace),
    or None if it does not end in `text`. Braces inside strings do not count."""
    depth, in_string, escaped = 0, False, False
    for position, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
    return None
