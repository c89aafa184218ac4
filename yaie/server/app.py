"""The OpenAI-compatible HTTP API over an AsyncEngine.

Every failure becomes OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`,
with a status a client can act on: 400 for a bad request (naming the field), 401 without the
API key, 404 for an unknown model, 429 when too many requests wait, 500 when the engine fails on
a request, 503 while shutting down. Inside an event stream, which has already answered 200, a
failure is sent as one last `data: {"error": ...}` event.

Each completion endpoint builds one stream of OpenAI chunk objects over a `_Generation`, the one
place that follows the engine requests behind a call: metrics, abort on disconnect, finish
reasons and usage. A streamed response sends those chunks as server-sent events; any other joins
them into the whole response (protocol's join_*_chunks), so the two always say the same.

A request is aborted in the engine (freeing its KV cache) as soon as its client disconnects,
whether it streams or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import yaie
from yaie.engine.async_engine import (
    AsyncEngine,
    EngineClosedError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from yaie.errors import InvalidRequestError, YaieError
from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.sampling_params import SamplingParams
from yaie.server import protocol as p
from yaie.server.metrics import RequestTracker, ServerMetrics
from yaie.server.web import PAGE_PATHS, web_router
from yaie.structured import tool_formats
from yaie.structured.tools import ToolCall

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"}) | PAGE_PATHS  # open even with an API key
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = p.ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(error=self.info).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def api_error(exc: Exception) -> APIError:
    """The APIError that tells a client about `exc`."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, exc.message, param=exc.param)
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            429,
            str(exc),
            type="rate_limit_error",
            code="too_many_waiting_requests",
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), type="server_error", code="shutting_down")
    if isinstance(exc, RequestFailedError):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    return APIError(500, f"internal server error ({type(exc).__name__}); see the server log", "server_error")


class RequireAPIKey:
    """ASGI middleware: without `Authorization: Bearer <key>`, only PUBLIC_PATHS answer.

    Checked before anything reads the body, so a client without the key learns nothing else.
    The scheme's name is case-insensitive (RFC 9110); the key is compared in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(key.strip(), self.expected):
                error = APIError(
                    401,
                    "missing or incorrect API key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitRequestBytes:
    """ASGI middleware: a 413 for a body over `max_bytes`, before any of it is parsed.

    The body is read here, counting, so a body without a Content-Length (chunked) or with a
    false one is cut off as soon as it passes the limit; the app then reads the kept copy.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # nobody is left to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large().response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return body.pop() if body else await receive()  # then the disconnect, when it comes

        await self.app(scope, replay, send)

    def _too_large(self) -> APIError:
        return APIError(
            413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large"
        )


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


class ClientDisconnected(APIError):
    """The client went away before its response was complete (its requests are aborted)."""

    def __init__(self) -> None:
        super().__init__(499, "the client disconnected")  # nobody is left to read this


async def _events(chunks: AsyncGenerator[BaseModel, None]) -> AsyncIterator[str]:
    """`chunks` as server-sent events, then [DONE]. The stream has already answered 200, so a
    failure is sent as one last error event."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield _event(chunk)
        except ClientDisconnected:
            return  # nobody is left to read the rest
        except Exception as exc:
            yield _error_event(exc)
    yield DONE_EVENT


def _event_stream(chunks: AsyncGenerator[BaseModel, None]) -> StreamingResponse:
    # X-Accel-Buffering: proxies such as nginx would otherwise hold tokens back.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(_events(chunks), media_type="text/event-stream", headers=headers)


ChunkT = TypeVar("ChunkT", bound=BaseModel)


async def _collect(chunks: AsyncGenerator[ChunkT, None]) -> list[ChunkT]:
    async with contextlib.aclosing(chunks):
        return [chunk async for chunk in chunks]


async def _merge(streams: Sequence[RequestStream]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """The outputs of several streams as they come, each with its stream's position."""
    if len(streams) == 1:  # one prompt, as most calls have: no task and no wait per output
        async for output in streams[0]:
            yield 0, output
        return
    pending = {asyncio.ensure_future(stream.__anext__()): i for i, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    output = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, output
    finally:
        for task in pending:
            task.cancel()


@contextlib.asynccontextmanager
async def _abort_on_exit(request: Request, streams: Sequence[RequestStream]) -> AsyncIterator[None]:
    """Abort the streams' requests if the client disconnects first, or on leaving the block
    (normally they have all finished by then, and closing them does nothing)."""

    async def watch() -> None:
        # The body has been read, so the next message can only be the disconnect.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for stream in streams:
            stream.close()

    watcher = asyncio.create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        for stream in streams:
            stream.close()


@dataclass
class _Update:
    """What one engine output brings to one choice of the response."""

    index: int  # the choice's place in the response: prompt * n + the choice's index
    prompt: int  # which of the call's prompts the choice answers
    choice: CompletionOutput
    output: RequestOutput  # the prompt's newest output, which `choice` belongs to
    first: bool  # in the prompt's first output
    finish_reason: str | None  # set on the one update that finishes the choice


class _Generation:
    """The engine requests behind one API call, one per prompt, followed together: the one place
    that feeds the metrics, aborts on disconnect, sees each choice finish, and counts usage."""

    def __init__(
        self,
        request: Request,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        n: int,
        metrics: ServerMetrics,
    ) -> None:
        self._request = request
        self._metrics = metrics
        self._streams = streams
        self._trackers = trackers
        self._n = n
        self._finals: list[RequestOutput | None] = [None] * len(streams)

    async def updates(self) -> AsyncGenerator[_Update, None]:
        """Every choice of every output, as they come. Raises ClientDisconnected at the end if
        the client left (which aborted the requests)."""
        finished: set[int] = set()  # choices whose finish has been told
        streams = self._streams
        async with _abort_on_exit(self._request, streams), contextlib.aclosing(_merge(streams)) as outputs:
            async for i, output in outputs:
                self._trackers[i].observe(output)
                first, self._finals[i] = self._finals[i] is None, output
                for choice in output.outputs:
                    index = i * self._n + choice.index
                    finish_reason = None
                    if choice.finish_reason is not None and index not in finished:
                        finished.add(index)
                        finish_reason = choice.finish_reason
                    yield _Update(index, i, choice, output, first, finish_reason)
        if any(stream.aborted for stream in streams):
            self._metrics.requests_aborted_slow_client.inc(sum(stream.overflowed for stream in streams))
            raise ClientDisconnected()

    def usage(self) -> p.Usage:
        """The tokens of every output so far: all of them once `updates()` has ended."""
        finals = [final for final in self._finals if final is not None]
        return p.Usage.of(
            prompt_tokens=sum(len(final.prompt_token_ids) for final in finals),
            completion_tokens=sum(len(choice.token_ids) for final in finals for choice in final.outputs),
            cached_tokens=sum(final.num_cached_tokens for final in finals),
        )


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server, each checked before any work is done for it."""

    max_waiting: int | None = None  # 429 while this many sequences already wait for admission
    max_request_bytes: int = 8 * 2**20  # 413 for a bigger body
    max_seqs_per_request: int = 256  # prompts x n; 400 beyond
    # When a request leaves max_tokens out. vLLM's default is the rest of the context, which lets
    # one careless request hold a sequence (and its KV cache) for thousands of steps; ours is a
    # bound of its own, cut to the room the prompt leaves.
    default_max_tokens: int = 2048


# A prompt longer than this many characters per token of context cannot fit, whatever it says
# (tokens average about 4 characters), so it is refused before anyone pays to tokenize it.
MAX_CHARS_PER_TOKEN = 16


class OpenAIServer:
    """The endpoints' logic; `build_app` routes to it."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str, limits: ServerLimits) -> None:
        self.engine = async_engine
        self.model_name = served_model_name
        self.limits = limits
        self.tokenizer = async_engine.tokenizer
        self.tool_format = tool_formats.for_template(getattr(self.tokenizer, "chat_template", None))
        self.metrics = ServerMetrics(async_engine.stats)
        self.max_prompt_chars = async_engine.max_model_len * MAX_CHARS_PER_TOKEN

    def _check_chars(self, texts: Sequence[str], param: str) -> None:
        if sum(len(text) for text in texts) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param}: longer than the {self.max_prompt_chars} characters that could fit this "
                f"model's context of {self.engine.max_model_len} tokens",
                param,
            )

    def _check_num_seqs(self, num_prompts: int, n: int) -> None:
        limit = self.limits.max_seqs_per_request
        if self.limits.max_waiting is not None:
            limit = min(limit, self.limits.max_waiting)  # more could never be admitted
        if num_prompts * n > limit:
            raise InvalidRequestError(
                f"n: {num_prompts} prompt(s) x n={n} is more than the {limit} sequences one request may run",
                "n",
            )

    def _with_default_max_tokens(
        self, params: SamplingParams, prompts: Sequence[list[int]]
    ) -> SamplingParams:
        if params.max_tokens is not None:
            return params
        room = self.engine.max_model_len - max(len(prompt) for prompt in prompts)
        # A prompt that leaves no room is the engine's error to report, so give it something.
        return dataclasses.replace(params, max_tokens=max(1, min(self.limits.default_max_tokens, room)))

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")

    async def _start(
        self,
        request: Request,
        body: p.SamplingRequest,
        params: SamplingParams,
        requests: Sequence[tuple[str, list[int]]],
    ) -> _Generation:
        """Add one engine request per (id, prompt token ids): all of them, or none."""
        trackers = [RequestTracker(self.metrics) for _ in requests]  # their clocks start on arrival
        params = self._with_default_max_tokens(params, [prompt for _, prompt in requests])
        try:
            streams = await self.engine.add_requests(requests, params, self.limits.max_waiting)
        except InvalidRequestError as exc:
            raise body.translate_error(exc) from exc
        return _Generation(request, streams, trackers, params.n, self.metrics)

    # -- chat completions ---------------------------------------------------------------------

    async def chat_completions(self, body: p.ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.to_sampling_params(self.tool_format)
        self._check_num_seqs(1, params.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = body.template_messages()
        self._check_chars([message["content"] for message in messages], "messages")
        prompt = await self.engine.encode_chat(messages, body.tool_definitions)
        generation = await self._start(request, body, params, [(request_id, prompt)])
        chunks = self._chat_chunks(request_id, body, params.n, generation)
        if body.stream:
            return _event_stream(chunks)
        return _json(p.join_chat_chunks(await _collect(chunks)))

    async def _chat_chunks(
        self, request_id: str, body: p.ChatCompletionRequest, n: int, generation: _Generation
    ) -> AsyncGenerator[p.ChatCompletionChunk, None]:
        created = p.now()

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> p.ChatCompletionChunk:
            return p.ChatCompletionChunk(
                id=request_id, created=created, model=body.model, choices=choices, usage=usage
            )

        roles = [p.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(n)]
        yield chunk(roles)
        # With tools, each choice's text is split into content and calls as it streams.
        parsers = [self.tool_format.parser(body.tool_names) for _ in range(n)] if body.calls_tools else None
        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                choice, index = update.choice, update.index
                content, calls = choice.delta_text, []
                if parsers is not None:
                    parser = parsers[index]
                    events = parser.feed(choice.delta_text)
                    if update.finish_reason is not None:
                        events += parser.finish()
                    content = "".join(value for kind, value in events if kind == "content")
                    calls = [value for kind, value in events if kind == "call"]
                if content or (body.logprobs and choice.delta_token_ids):
                    logprobs = None
                    if body.logprobs:
                        logprobs = p.chat_logprobs(_new_logprobs(choice), self._decode_token)
                    delta = {"content": content}
                    yield chunk([p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs)])
                for call in calls:
                    for delta in _tool_call_deltas(call):
                        yield chunk([p.ChatChunkChoice(index=index, delta={"tool_calls": [delta]})])
                if (reason := update.finish_reason) is not None:
                    if reason == "stop" and parsers is not None and parsers[index].num_calls:
                        reason = "tool_calls"
                    yield chunk([p.ChatChunkChoice(index=index, delta={}, finish_reason=reason)])
        if body.include_usage or not body.stream:  # a whole response always has its usage
            yield chunk([], usage=generation.usage())

    # -- text completions ---------------------------------------------------------------------

    async def completions(self, body: p.CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.to_sampling_params()
        prompts = body.prompts()
        self._check_num_seqs(len(prompts), params.n)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                self._check_chars([prompt], "prompt" if len(prompts) == 1 else f"prompt[{i}]")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        token_ids = await asyncio.gather(
            *(self.engine.encode(prompt) for prompt in prompts if isinstance(prompt, str))
        )
        encoded = iter(token_ids)
        requests = [
            (
                request_id if len(prompts) == 1 else f"{request_id}-{i}",
                next(encoded) if isinstance(prompt, str) else prompt,
            )
            for i, prompt in enumerate(prompts)
        ]
        generation = await self._start(request, body, params, requests)
        chunks = self._completion_chunks(request_id, body, prompts, generation)
        if body.stream:
            return _event_stream(chunks)
        return _json(p.join_completion_chunks(await _collect(chunks)))

    async def _completion_chunks(
        self,
        request_id: str,
        body: p.CompletionRequest,
        prompts: Sequence[str | list[int]],
        generation: _Generation,
    ) -> AsyncGenerator[p.CompletionResponse, None]:
        created = p.now()
        text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts

        def chunk(choices: list[p.CompletionChoice], usage: p.Usage | None = None) -> p.CompletionResponse:
            return p.CompletionResponse(
                id=request_id, created=created, model=body.model, choices=choices, usage=usage
            )

        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                choice = update.choice
                text, tokens = choice.delta_text, []
                if update.first and body.echo:  # the echo goes first
                    prompt = prompts[update.prompt]
                    text = (prompt if isinstance(prompt, str) else await self.engine.decode(prompt)) + text
                    if body.logprobs is not None:
                        tokens = _prompt_logprobs(update.output)
                tokens += [(lp.token_id, lp) for lp in _new_logprobs(choice)]
                if text or tokens:
                    logprobs = None
                    if body.logprobs is not None:
                        offset = text_offsets.get(update.index, 0)
                        logprobs = p.completion_logprobs(tokens, self._decode_token, offset)
                        text_offsets[update.index] = offset + sum(len(token) for token in logprobs.tokens)
                    yield chunk([p.CompletionChoice(index=update.index, text=text, logprobs=logprobs)])
                if (reason := update.finish_reason) is not None:
                    yield chunk([p.CompletionChoice(index=update.index, text="", finish_reason=reason)])
        if body.include_usage or not body.stream:  # a whole response always has its usage
            yield chunk([], usage=generation.usage())

    # -- everything else ----------------------------------------------------------------------

    async def models(self) -> Response:
        card = p.ModelCard(
            id=self.model_name,
            root=str(self.engine.model_path),
            max_model_len=self.engine.max_model_len,
        )
        return _json(p.ModelList(data=[card]))

    async def tokenize(self, body: p.TokenizeRequest) -> Response:
        self._check_model(body.model)
        if body.prompt is not None and body.messages is None:
            self._check_chars([body.prompt], "prompt")
            tokens = await self.engine.encode(body.prompt)
        elif body.messages is not None and body.prompt is None:
            messages = [message.to_template() for message in body.messages]
            self._check_chars([message["content"] for message in messages], "messages")
            tokens = await self.engine.encode_chat(messages)
        else:
            raise InvalidRequestError("prompt: give either prompt or messages", "prompt")
        return _json(
            p.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.engine.max_model_len)
        )

    async def detokenize(self, body: p.DetokenizeRequest) -> Response:
        self._check_model(body.model)
        vocab_size = self.engine.vocab_size
        if body.tokens and not 0 <= min(body.tokens) <= max(body.tokens) < vocab_size:
            raise InvalidRequestError(f"tokens: must be token ids in [0, {vocab_size})", "tokens")
        return _json(p.DetokenizeResponse(prompt=await self.engine.decode(body.tokens)))

    async def health(self) -> Response:
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        return Response(status_code=200)

    async def version(self) -> dict[str, str | int]:
        """yaie's version (vLLM's field), what the weights run as and what the KV cache stores."""
        info = self.engine.model_info
        return {
            "version": yaie.__version__,
            "quantization": info.quantization,
            "kernel_isa": info.kernel_isa,
            "weight_bytes": info.weight_bytes,
            "kv_cache_dtype": info.kv_cache_dtype,
        }

    async def prometheus_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    limits: ServerLimits = ServerLimits(),
) -> FastAPI:
    """The API for `async_engine`, which the caller starts and shuts down."""
    server = OpenAIServer(async_engine, served_model_name, limits)
    app = FastAPI(title="yaie", version=yaie.__version__)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus_metrics, methods=["GET"])
    app.include_router(web_router(async_engine))

    # Errors we raise on purpose are simply answered. Anything else reaches the catch-all, whose
    # answer Starlette sends and then re-raises the error, so the server's log has the traceback.
    app.add_exception_handler(APIError, _on_error)
    app.add_exception_handler(YaieError, _on_error)
    app.add_exception_handler(Exception, _on_error)
    app.add_exception_handler(RequestValidationError, _on_invalid_request)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    # The last added runs first: the key is checked before the body is read.
    app.add_middleware(LimitRequestBytes, max_bytes=limits.max_request_bytes)
    if api_key:
        app.add_middleware(RequireAPIKey, api_key=api_key)
    return app


async def _on_error(request: Request, exc: Exception) -> Response:
    return api_error(exc).response()


async def _on_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = p.describe_validation_error(exc.errors())
    if error.param is None and not _is_json(request.headers.get("content-type")):
        error = InvalidRequestError("the body must be JSON, sent with Content-Type: application/json")
    return api_error(error).response()


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")


def _new_logprobs(choice: CompletionOutput) -> list[TokenLogprob]:
    """The logprobs of the tokens this output added to the choice."""
    num_tokens = len(choice.token_ids)
    return (choice.logprobs or [])[num_tokens - len(choice.delta_token_ids) : num_tokens]


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


def _prompt_logprobs(output: RequestOutput) -> list[tuple[int, TokenLogprob | None]]:
    """(token id, logprob) for each prompt token, for echo with logprobs."""
    # to_sampling_params asks for prompt logprobs whenever echo comes with logprobs.
    assert output.prompt_logprobs is not None
    return list(zip(output.prompt_token_ids, output.prompt_logprobs, strict=True))


def _error_event(exc: Exception) -> str:
    error = api_error(exc)
    if error.status == 500:
        logger.error("a streamed request failed", exc_info=exc)
    return _event(p.ErrorResponse(error=error.info))
