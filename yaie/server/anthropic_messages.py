"""/v1/messages' responses (Anthropic's Messages API): the stream of events, or the whole message.

Both are built by one `ContentBlocks`, fed the choice's text split into content and tool calls
by the model's tool format, so the streamed message adds up to the whole one: a `thinking` block
first for the reasoning (with a reasoning parser, when the request enables thinking:
reasoning.py), a text block for the text (whitespace alone, as around calls, is no block), a
`tool_use` block per call. The stream is Anthropic's order: message_start, ping, then per block
content_block_start, its deltas (thinking_delta, text_delta, or the call's input as one
input_json_delta) and content_block_stop, then message_delta (stop_reason, output tokens) and
message_stop.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Sequence

from pydantic import BaseModel

from yaie.outputs import CompletionOutput, RequestOutput
from yaie.server import anthropic_protocol as a
from yaie.server import protocol as p
from yaie.server.errors import ANTHROPIC_PATHS, APIError
from yaie.server.reasoning import ReasoningSplitter, Split
from yaie.server.streaming import EventFormat, Generation
from yaie.structured.tool_formats import ToolCallSplitter, ToolFormat
from yaie.structured.tools import Event


def _named_event(event: BaseModel) -> str:
    """Anthropic's server-sent event: its type as the event's name, then the event."""
    return f"event: {event.model_dump(include={'type'})['type']}\ndata: {event.model_dump_json()}\n\n"


def _error_event(error: APIError) -> str:
    return f"event: error\ndata: {json.dumps(error.body(ANTHROPIC_PATHS))}\n\n"


ANTHROPIC_EVENTS = EventFormat(_named_event, _error_event, done="")  # no [DONE]: message_stop ends it


class ContentBlocks:
    """A message's content blocks, built from a tool parser's events as they come; each
    `add` and `close` returns the stream events that tell what it changed."""

    def __init__(self) -> None:
        self.blocks: list[a.Content] = []
        self._text_open = False  # the last block is text, and more may come
        self._thinking_open = False  # the last block is thinking, and more may come
        self._space = ""  # whitespace held back until text follows it (none does around calls)

    def think(self, thinking: str) -> list[a.StreamEvent]:
        """Reasoning, which comes before any other block."""
        if not thinking:
            return []
        out: list[a.StreamEvent] = []
        if not self._thinking_open:
            self._thinking_open = True
            self.blocks.append(a.ThinkingContent(thinking=""))
            empty = a.ThinkingContent(thinking="")
            out.append(a.ContentBlockStart(index=len(self.blocks) - 1, content_block=empty))
        block = self.blocks[-1]
        assert isinstance(block, a.ThinkingContent)
        block.thinking += thinking
        delta = {"type": "thinking_delta", "thinking": thinking}
        return [*out, a.ContentBlockDelta(index=len(self.blocks) - 1, delta=delta)]

    def add(self, events: Sequence[Event]) -> list[a.StreamEvent]:
        out: list[a.StreamEvent] = []
        for kind, value in events:
            if kind == "content":
                out += self._text(value)
            else:
                out += self.close()
                self._space = ""
                call = a.ToolUseContent(id=value.id, name=value.name, input=json.loads(value.arguments))
                index = len(self.blocks)
                self.blocks.append(call)
                out += [
                    a.ContentBlockStart(index=index, content_block=call.model_copy(update={"input": {}})),
                    a.ContentBlockDelta(
                        index=index, delta={"type": "input_json_delta", "partial_json": value.arguments}
                    ),
                    a.ContentBlockStop(index=index),
                ]
        return out

    def _text(self, text: str) -> list[a.StreamEvent]:
        if not self._text_open and not text.strip():
            self._space += text
            return []
        out = self.close() if self._thinking_open else []  # text follows the thinking
        if not self._text_open:
            self._text_open = True
            self.blocks.append(a.TextContent(text=""))
            out.append(a.ContentBlockStart(index=len(self.blocks) - 1, content_block=a.TextContent(text="")))
        text, self._space = self._space + text, ""
        block = self.blocks[-1]
        assert isinstance(block, a.TextContent)
        block.text += text
        out.append(
            a.ContentBlockDelta(index=len(self.blocks) - 1, delta={"type": "text_delta", "text": text})
        )
        return out

    def close(self) -> list[a.StreamEvent]:
        """End the open text or thinking block, if any."""
        if not (self._text_open or self._thinking_open):
            return []
        self._text_open = self._thinking_open = False
        return [a.ContentBlockStop(index=len(self.blocks) - 1)]


def stop_reason(choice: CompletionOutput, parser: ToolCallSplitter | None) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a finished choice."""
    # Anthropic has no stop reason for a deadline: a timeout is reported as the answer cut
    # short that it is, which every client handles (docs/server.md).
    if choice.finish_reason in ("length", "timeout"):
        return "max_tokens", None
    if choice.finish_reason != "stop":
        return choice.finish_reason, None  # the engine's own reason (an abort), as it said it
    if parser is not None and parser.num_calls:
        return "tool_use", None
    if isinstance(choice.stop_reason, str):  # a stop string, not the end-of-sequence token
        return "stop_sequence", choice.stop_reason
    return "end_turn", None


class AnthropicMessage:
    """The response to one Messages request (one choice: the API has no `n`)."""

    def __init__(
        self,
        message_id: str,
        model: str,
        chat: p.ChatCompletionRequest,
        tool_format: ToolFormat,
        starts_in_reasoning: bool | None = None,
        thinks: bool = False,
    ) -> None:
        self.message_id = message_id
        self.model = model
        self.chat = chat  # the request, as the chat completion request it became
        self.tool_format = tool_format
        self.starts_in_reasoning = starts_in_reasoning  # None: no reasoning parser, no split
        # The request enabled thinking: the reasoning is its blocks. Otherwise it is left out,
        # as Anthropic's models show no thinking unless asked.
        self.thinks = thinks

    def _parser(self) -> ToolCallSplitter | None:
        return self.tool_format.parser(self.chat.tool_names) if self.chat.calls_tools else None

    def _splitter(self) -> ReasoningSplitter | None:
        in_reasoning = self.starts_in_reasoning
        return None if in_reasoning is None else ReasoningSplitter(in_reasoning)

    def _add(
        self, blocks: ContentBlocks, splitter: ReasoningSplitter | None, parser: ToolCallSplitter | None,
        text: str, finished: bool,
    ) -> list[a.StreamEvent]:  # fmt: skip
        """`text`, new output, into `blocks`: its reasoning, its content and calls."""
        split = Split(content=text)
        if splitter is not None:
            split = splitter.feed(text) + (splitter.finish() if finished else Split())
        thinking = blocks.think(split.reasoning) if self.thinks else []
        return thinking + blocks.add(self._events(parser, split.content, finished))

    def _events(self, parser: ToolCallSplitter | None, text: str, finished: bool) -> list[Event]:
        if parser is None:
            return [("content", text)] if text else []
        return parser.feed(text) + (parser.finish() if finished else [])

    def _message(
        self, content: list[a.Content], usage: p.Usage, reason: tuple[str | None, str | None] = (None, None)
    ) -> a.MessageResponse:
        return a.MessageResponse(
            id=self.message_id,
            content=content,
            model=self.model,
            stop_reason=reason[0],
            stop_sequence=reason[1],
            usage=a.Usage.of(usage),
        )

    async def events(self, generation: Generation) -> AsyncGenerator[a.StreamEvent, None]:
        """The stream. message_start waits for the first output, which tells the cached tokens."""
        parser, splitter, blocks = self._parser(), self._splitter(), ContentBlocks()
        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                if update.first:
                    yield a.MessageStart(message=self._message([], generation.usage()))
                    yield a.Ping()
                choice = update.choice
                finished = update.finish_reason is not None
                for event in self._add(blocks, splitter, parser, choice.delta_text, finished):
                    yield event
                if update.finish_reason is not None:
                    for event in blocks.close():
                        yield event
                    reason, sequence = stop_reason(choice, parser)
                    output_tokens = generation.usage().completion_tokens
                    yield a.MessageDelta(
                        delta={"stop_reason": reason, "stop_sequence": sequence},
                        usage=a.MessageDeltaUsage(output_tokens=output_tokens),
                    )
                    yield a.MessageStop()

    def response(self, finals: Sequence[RequestOutput], usage: p.Usage) -> a.MessageResponse:
        """The whole message, from the finished output."""
        [final] = finals
        [choice] = final.outputs
        parser, blocks = self._parser(), ContentBlocks()
        self._add(blocks, self._splitter(), parser, choice.text, finished=True)
        blocks.close()
        return self._message(blocks.blocks, usage, stop_reason(choice, parser))
