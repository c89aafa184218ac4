"""Which format a model writes its tool calls in, picked once from its chat template, never by
guessing at each answer: a Llama-3 template that renders tools asks for bare JSON objects
(yaie/structured/llama3_tools.py); every other model, whether its template renders tools in
the Hermes style (Qwen's) or yaie renders them for it (ChatML), writes `<tool_call>` blocks
(yaie/structured/tools.py). So an ordinary JSON answer from a ChatML model stays content.

A format gives the grammar of a required call and the parser that splits the model's text
into content and calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from yaie.structured import llama3_tools, tools
from yaie.structured.spec import StructuredOutputs, ToolCallSpans
from yaie.structured.tools import CallSpans, Event


class ToolCallSplitter(Protocol):
    """One choice's text, fed as it streams, split into ("content", text) and ("call", ToolCall)
    events; `finish` gives out what is left once the text is complete."""

    num_calls: int

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


@dataclass(frozen=True)
class ToolFormat:
    name: str
    # (tools, the name of the one to call or None for any) -> the grammar of one valid call
    call_grammar: Callable[[Sequence[dict[str, Any]], str | None], StructuredOutputs]
    # the names of the request's tools -> a parser for one choice
    parser: Callable[[Collection[str]], ToolCallSplitter]
    # the names of the request's tools -> where one choice's calls are, for the engine's stop rules
    spans: Callable[[Collection[str]], CallSpans]

    def call_spans(self, names: Collection[str]) -> ToolCallSpans:
        """What a request whose free text may hold calls of `names` tells the engine."""
        return ToolCallSpans(self.name, tuple(names))


HERMES = ToolFormat(
    "hermes", tools.call_grammar, lambda names: tools.ToolCallParser(), lambda names: tools.HermesCallSpans()
)
LLAMA3 = ToolFormat(
    "llama3", llama3_tools.call_grammar, llama3_tools.Llama3ToolCallParser, llama3_tools.Llama3CallSpans
)
FORMATS = {tool_format.name: tool_format for tool_format in (HERMES, LLAMA3)}


def call_spans(spec: ToolCallSpans) -> CallSpans:
    """A tracker of one choice's calls, for a request that says where they may be."""
    return FORMATS[spec.format].spans(spec.names)


def for_template(chat_template: str | None) -> ToolFormat:
    """The format a model with this chat template writes its calls in."""
    if tools.template_knows_tools(chat_template) and llama3_tools.is_llama3_template(chat_template or ""):
        return LLAMA3
    return HERMES
