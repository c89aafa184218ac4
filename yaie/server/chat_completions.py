"""/v1/chat/completions' responses: streamed chunks of deltas, or the whole completion.

Both say the same: the choice's content (with tool calls, when the request has tools, split out
of the text by the model's tool format), its reasoning (`reasoning_content`, split off the text
before that when the server has a reasoning parser: reasoning.py), its logprobs, its finish
reason ("tool_calls" when a choice that stopped made calls) and vLLM's stop_reason (the stop
string or token that ended it), and the usage.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from yaie.outputs import CompletionOutput, RequestOutput
from yaie.server import protocol as p
from yaie.server.reasoning import ReasoningSplitter, Split, split_text
from yaie.server.streaming import Generation, new_logprobs
from yaie.structured.tool_formats import ToolCallSplitter, ToolFormat
from yaie.structured.tools import ToolCall


class ChatCompletion:
    """The response to one chat completion request."""

    def __init__(
        self,
        request_id: str,
        model: str,
        body: p.ChatCompletionRequest,
        tool_format: ToolFormat,
        decode: p.Decode,
        starts_in_reasoning: bool | None = None,
    ) -> None:
        self.request_id = request_id
        self.starts_in_reasoning = starts_in_reasoning  # None: no reasoning parser, no split
        self.model = model
        self.body = body
        self.tool_format = tool_format
        self.decode = decode
        self.created = p.now()

    def _parser(self) -> ToolCallSplitter | None:
        """With tools, a choice's text is parsed into content and calls."""
        return self.tool_format.parser(self.body.tool_names) if self.body.calls_tools else None

    def _splitter(self) -> ReasoningSplitter | None:
        in_reasoning = self.starts_in_reasoning
        return None if in_reasoning is None else ReasoningSplitter(in_reasoning)

    async def chunks(self, generation: Generation) -> AsyncGenerator[p.ChatCompletionChunk, None]:
        """The stream: a role delta for each choice, then reasoning, content or tool call deltas
        as tokens come, a finish delta per choice (with its stop_reason), and the usage last when
        the request asks for it."""
        body, n = self.body, generation.n
        yield self._chunk(
            [p.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(n)]
        )
        parsers = [self._parser() for _ in range(n)]
        splitters = [self._splitter() for _ in range(n)]
        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                choice, index = update.choice, update.index
                split = Split(content=choice.delta_text)
                if (splitter := splitters[index]) is not None:
                    split = splitter.feed(choice.delta_text)
                    if update.finish_reason is not None:
                        split += splitter.finish()
                content, calls = split.content, []
                if (parser := parsers[index]) is not None:
                    events = parser.feed(split.content)
                    if update.finish_reason is not None:
                        events += parser.finish()
                    content = "".join(value for kind, value in events if kind == "content")
                    calls = [value for kind, value in events if kind == "call"]
                if split.reasoning or content or (body.logprobs and choice.delta_token_ids):
                    logprobs = p.chat_logprobs(new_logprobs(choice), self.decode) if body.logprobs else None
                    delta = {"reasoning_content": split.reasoning} if split.reasoning else {}
                    if content or not split.reasoning:
                        delta["content"] = content
                    yield self._chunk([p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                for call in calls:
                    for call_delta in _tool_call_deltas(call):
                        yield self._chunk(
                            [p.ChatChunkChoice(index=index, delta={"tool_calls": [call_delta]})]
                        )
                if update.finish_reason is not None:
                    reason = _finish_reason(update.finish_reason, parser)
                    last = p.ChatChunkChoice(
                        index=index, delta={}, finish_reason=reason, stop_reason=choice.stop_reason
                    )
                    yield self._chunk([last])
        if body.include_usage:
            yield self._chunk([], usage=generation.usage())

    def _chunk(self, choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def response(self, finals: Sequence[RequestOutput], usage: p.Usage) -> p.ChatCompletionResponse:
        """The whole completion, from the finished output (one prompt, `n` choices)."""
        [final] = finals
        choices = [self._choice(choice) for choice in sorted(final.outputs, key=lambda c: c.index)]
        return p.ChatCompletionResponse(
            id=self.request_id, created=self.created, model=self.model, choices=choices, usage=usage
        )

    def _choice(self, choice: CompletionOutput) -> p.ChatChoice:
        split = Split(content=choice.text)
        if self.starts_in_reasoning is not None:
            split = split_text(choice.text, self.starts_in_reasoning)
        content, calls = split.content, []
        if (parser := self._parser()) is not None:
            events = parser.feed(split.content) + parser.finish()
            content = "".join(value for kind, value in events if kind == "content")
            calls = [value for kind, value in events if kind == "call"]
        logprobs = None
        if self.body.logprobs and choice.token_ids:
            logprobs = p.chat_logprobs(choice.logprobs or [], self.decode)
        return p.ChatChoice(
            index=choice.index,
            message=_message(content, calls, split.reasoning or None),
            logprobs=logprobs,
            finish_reason=_finish_reason(choice.finish_reason, parser),
            stop_reason=choice.stop_reason,
        )


def _finish_reason(reason: str | None, parser: ToolCallSplitter | None) -> str | None:
    """A choice that stopped after making calls finished for them (OpenAI's "tool_calls")."""
    return "tool_calls" if reason == "stop" and parser is not None and parser.num_calls else reason


def _message(content: str, calls: list[ToolCall], reasoning: str | None) -> p.AssistantMessage:
    if not calls:
        return p.AssistantMessage(content=content, reasoning_content=reasoning)
    tool_calls = [
        p.ToolCall(id=call.id, function=p.FunctionCall(name=call.name, arguments=call.arguments))
        for call in calls
    ]
    # As OpenAI: content is null for a turn of calls alone (the whitespace around them is no content).
    return p.AssistantMessage(
        content=content if content.strip() else None, reasoning_content=reasoning, tool_calls=tool_calls
    )


def _tool_call_deltas(call: ToolCall) -> list[dict[str, Any]]:
    """One call as OpenAI streams it: its id, type and name first, then its arguments."""
    return [
        {
            "index": call.index,
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": ""},
        },
        {"index": call.index, "function": {"arguments": call.arguments}},
    ]
