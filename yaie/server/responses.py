"""/v1/responses' answers: the whole Response, or its stream of named events; and the store of
finished responses that `previous_response_id` continues and GET/DELETE reach.

A response's output is a "message" item with the model's text and a "function_call" item per
call it made (when the request has tools, the text is split by the model's tool format, as chat
completions do). Its status is "incomplete" (incomplete_details.reason "max_output_tokens") when
the output ran out of tokens, or (reason "timeout", yaie's) when the request's deadline passed.
Streamed, it comes as OpenAI's events, each an SSE `event:` line with the event's type and a
`data:` line with a `sequence_number`: response.created,
response.in_progress, then per item response.output_item.added, (for a message)
response.content_part.added, response.output_text.delta..., response.output_text.done,
response.content_part.done, (for a call) response.function_call_arguments.delta/done,
response.output_item.done, and last response.completed (response.incomplete when cut short).
A failure once the stream has begun is an "error" event.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from yaie.outputs import RequestOutput
from yaie.sampling_params import SamplingParams
from yaie.server import protocol as p
from yaie.server import responses_protocol as rp
from yaie.server.errors import APIError
from yaie.server.streaming import EventFormat, Generation
from yaie.structured.tool_formats import ToolCallSplitter, ToolFormat
from yaie.structured.tools import Event, ToolCall

# The store keeps the newest STORE_MAX_ENTRIES responses, each for STORE_TTL_SECONDS after it
# finished: enough to continue a conversation or a tool loop, while a server that is never asked
# to forget (store defaults to true) still holds a bounded amount.
STORE_MAX_ENTRIES = 1024
STORE_TTL_SECONDS = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: rp.ResponseObject
    # The conversation up to and with this response, without its instructions: what a response
    # that continues it (previous_response_id) comes after.
    conversation: list[p.ChatMessage]
    expires_at: float


class ResponseStore:
    """Finished responses by id, at most `max_entries` of them (the oldest go first), each for
    `ttl_seconds`. `clock` is monotonic seconds."""

    def __init__(
        self,
        max_entries: int = STORE_MAX_ENTRIES,
        ttl_seconds: float = STORE_TTL_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        self._drop_expired()
        return len(self._entries)

    def put(self, response: rp.ResponseObject, conversation: list[p.ChatMessage]) -> None:
        self._drop_expired()
        self._entries[response.id] = StoredResponse(response, conversation, self._clock() + self.ttl_seconds)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response, or a 404 (naming `param`) if there is none or it expired."""
        self._drop_expired()
        stored = self._entries.get(response_id)
        if stored is None:
            raise self._not_found(response_id, param)
        return stored

    def delete(self, response_id: str) -> None:
        self._drop_expired()
        if self._entries.pop(response_id, None) is None:
            raise self._not_found(response_id, None)

    def _drop_expired(self) -> None:
        # Entries expire in the order they were put, so the expired ones are at the front.
        now = self._clock()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires_at > now:
                break
            self._entries.popitem(last=False)

    def _not_found(self, response_id: str, param: str | None) -> APIError:
        message = (
            f"no stored response has the id {response_id!r} (this server keeps the newest "
            f"{self.max_entries} responses made with store=true, each for {self.ttl_seconds:g} seconds)"
        )
        return APIError(404, message, param=param, code="response_not_found")


def _named_event(event: dict[str, Any]) -> str:
    """A server-sent event named by its type (the Responses API sends no [DONE])."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseBuilder:
    """The answer to one Responses request, whole or streamed; a finished one is stored if the
    request says `store`."""

    def __init__(
        self,
        response_id: str,
        model: str,
        body: rp.ResponsesRequest,
        chat: rp.ResponsesChat,
        params: SamplingParams,
        history: Sequence[p.ChatMessage],
        tool_format: ToolFormat,
        store: ResponseStore,
    ) -> None:
        self.response_id = response_id
        self.model = model
        self.body = body
        self.chat = chat
        self.params = params
        self.history = history
        self.tool_format = tool_format
        self.store = store
        self.created_at = p.now()
        self._sequence = itertools.count()  # the streamed events' sequence numbers

    def _parser(self) -> ToolCallSplitter | None:
        return self.tool_format.parser(self.chat.tool_names) if self.chat.calls_tools else None

    def _split(self, events: list[Event]) -> tuple[str, list[ToolCall]]:
        content = "".join(value for kind, value in events if kind == "content")
        return content, [value for kind, value in events if kind == "call"]

    def response(self, finals: Sequence[RequestOutput], usage: p.Usage) -> rp.ResponseObject:
        """The whole response, from the finished output."""
        [final] = finals
        [choice] = final.outputs
        content, calls = choice.text, list[ToolCall]()
        if (parser := self._parser()) is not None:
            content, calls = self._split(parser.feed(choice.text) + parser.finish())
        status = _status(choice.finish_reason)
        output: list[rp.OutputItem] = []
        # As OpenAI: a turn of calls alone has no message (the whitespace around them is none).
        if content.strip() or not calls:
            output.append(_message(content, status))
        output += [_function_call(call) for call in calls]
        return self._finish(output, choice.finish_reason, usage)

    def event_format(self) -> EventFormat[dict[str, Any]]:
        """How the stream is written: named events, and a failure once it began as its last, an
        "error" event numbered in sequence with the rest."""

        def error(error: APIError) -> str:
            info = error.info
            return _named_event(self._event("error", code=info.code, message=info.message, param=info.param))

        return EventFormat(_named_event, error, done="")

    def events(self, generation: Generation) -> AsyncGenerator[dict[str, Any], None]:
        """The stream of events, each numbered in sequence."""
        return self._events(generation, self._event)

    def _event(self, type: str, **fields: Any) -> dict[str, Any]:
        dumped = {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in fields.items()}
        return {"type": type, "sequence_number": next(self._sequence), **dumped}

    async def _events(
        self, generation: Generation, event: Callable[..., dict[str, Any]]
    ) -> AsyncGenerator[dict[str, Any], None]:
        started = self._response("in_progress", [], None)
        yield event("response.created", response=started)
        yield event("response.in_progress", response=started)
        output: list[rp.OutputItem] = []
        message: _OpenMessage | None = None
        held = ""  # whitespace before anything else, which is no message if calls follow
        parser = self._parser()
        finish_reason: str | None = None
        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                events: list[Event] = [("content", update.choice.delta_text)]
                if parser is not None:
                    events = parser.feed(update.choice.delta_text)
                    if update.finish_reason is not None:
                        events += parser.finish()
                finish_reason = update.finish_reason or finish_reason
                for kind, value in events:
                    if kind == "content" and message is None and not (held + value).strip():
                        held += value
                    elif kind == "content":
                        if message is None:
                            message = _OpenMessage(len(output))
                            for item in message.open(event):
                                yield item
                            value, held = held + value, ""
                        for item in message.add(value, event):
                            yield item
                    else:
                        if message is not None:
                            for item in message.close("completed", event):
                                yield item
                            output.append(message.item("completed"))
                            message = None
                        held = ""
                        call = _function_call(value)
                        for item in _call_events(call, len(output), event):
                            yield item
                        output.append(call)
        status = _status(finish_reason)
        if message is None and not output:  # the output is at least one (perhaps empty) message
            message = _OpenMessage(0)
            for item in message.open(event):
                yield item
            if held:
                for item in message.add(held, event):
                    yield item
        if message is not None:
            for item in message.close(status, event):
                yield item
            output.append(message.item(status))
        response = self._finish(output, finish_reason, generation.usage())
        yield event(
            "response.completed" if status == "completed" else "response.incomplete", response=response
        )

    def _response(
        self,
        status: str,
        output: list[rp.OutputItem],
        usage: p.Usage | None,
        finish_reason: str | None = None,
    ) -> rp.ResponseObject:
        return rp.ResponseObject(
            id=self.response_id,
            created_at=self.created_at,
            status=status,  # type: ignore[arg-type]
            incomplete_details=rp.IncompleteDetails(
                reason="timeout" if finish_reason == "timeout" else "max_output_tokens"
            )
            if status == "incomplete"
            else None,
            model=self.model,
            output=output,
            usage=None if usage is None else rp.ResponseUsage.of(usage),
            temperature=self.params.temperature,
            top_p=self.params.top_p,
            **self.body.echo(),
        )

    def _finish(
        self, output: list[rp.OutputItem], finish_reason: str | None, usage: p.Usage
    ) -> rp.ResponseObject:
        response = self._response(_status(finish_reason), output, usage, finish_reason)
        if self.body.store:
            self.store.put(response, [*self.history, *self.body.input_messages(), _turn(output)])
        return response


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason in ("length", "timeout") else "completed"


def _message(text: str, status: str) -> rp.OutputMessage:
    return rp.OutputMessage(
        id=f"msg_{uuid.uuid4().hex}",
        status=status,  # type: ignore[arg-type]
        content=[rp.OutputText(text=text)],
    )


def _function_call(call: ToolCall) -> rp.FunctionCallOutput:
    return rp.FunctionCallOutput(
        id=f"fc_{uuid.uuid4().hex}",
        status="completed",
        call_id=call.id,
        name=call.name,
        arguments=call.arguments,
    )


def _call_events(
    call: rp.FunctionCallOutput, index: int, event: Callable[..., dict[str, Any]]
) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: the item without arguments, its arguments, the item done."""
    started = call.model_copy(update={"status": "in_progress", "arguments": ""})
    return [
        event("response.output_item.added", output_index=index, item=started),
        event(
            "response.function_call_arguments.delta",
            item_id=call.id,
            output_index=index,
            delta=call.arguments,
        ),
        event(
            "response.function_call_arguments.done",
            item_id=call.id,
            output_index=index,
            name=call.name,
            arguments=call.arguments,
        ),
        event("response.output_item.done", output_index=index, item=call),
    ]


class _OpenMessage:
    """The message item being streamed: its text so far, at its place in the output."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.id = f"msg_{uuid.uuid4().hex}"
        self.text = ""

    def item(self, status: str) -> rp.OutputMessage:
        content = [rp.OutputText(text=self.text)] if status != "in_progress" else []
        return rp.OutputMessage(id=self.id, status=status, content=content)  # type: ignore[arg-type]

    def _part(self, text: str) -> dict[str, Any]:
        return {
            "item_id": self.id,
            "output_index": self.index,
            "content_index": 0,
            "part": rp.OutputText(text=text),
        }

    def open(self, event: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
        return [
            event("response.output_item.added", output_index=self.index, item=self.item("in_progress")),
            event("response.content_part.added", **self._part("")),
        ]

    def add(self, text: str, event: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
        if not text:
            return []
        self.text += text
        where = {"item_id": self.id, "output_index": self.index, "content_index": 0}
        return [event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def close(self, status: str, event: Callable[..., dict[str, Any]]) -> list[dict[str, Any]]:
        where = {"item_id": self.id, "output_index": self.index, "content_index": 0}
        return [
            event("response.output_text.done", **where, text=self.text, logprobs=[]),
            event("response.content_part.done", **self._part(self.text)),
            event("response.output_item.done", output_index=self.index, item=self.item(status)),
        ]


def _turn(output: Sequence[rp.OutputItem]) -> p.ChatMessage:
    """The response's output as the assistant turn a continuation comes after."""
    text = "".join(
        part.text for item in output if isinstance(item, rp.OutputMessage) for part in item.content
    )
    calls = [
        p.ToolCallIn(id=item.call_id, function=p.ToolCallFunction(name=item.name, arguments=item.arguments))
        for item in output
        if isinstance(item, rp.FunctionCallOutput)
    ]
    return p.ChatMessage(
        role="assistant", content=text if text or not calls else None, tool_calls=calls or None
    )
