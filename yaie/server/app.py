"""The OpenAI-compatible HTTP API over an AsyncEngine.

Every failure becomes OpenAI's error body, `{"error": {"message", "type", "param", "code"}}`,
with a status a client can act on: 400 for a bad request (naming the field), 401 without the
API key, 404 for an unknown model, 429 when too many requests wait, 500 when the engine fails on
a request, 503 while shutting down. Inside an event stream, which has already answered 200, a
failure is sent as one last `data: {"error": ...}` event.

A request is aborted in the engine (freeing its KV cache) as soon as its client disconnects,
whether it streams or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

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
from yaie.server import protocol as p
from yaie.server.metrics import RequestTracker, ServerMetrics
from yaie.server.web import PAGE_PATHS, web_router

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
        headers: dict[str, str] | None = None,
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
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "missing or incorrect API key", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


DONE_EVENT = "data: [DONE]\n\n"


def _event_stream(events: AsyncIterator[str]) -> StreamingResponse:
    # X-Accel-Buffering: proxies such as nginx would otherwise hold tokens back.
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _merge(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The outputs of several streams as they come, each with its stream's position."""
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


class OpenAIServer:
    """The endpoints' logic; `build_app` routes to it."""

    def __init__(self, async_engine: AsyncEngine, served_model_name: str, max_waiting: int | None) -> None:
        self.engine = async_engine
        self.model_name = served_model_name
        self.max_waiting = max_waiting
        self.tokenizer = async_engine.tokenizer
        self.metrics = ServerMetrics(async_engine.stats)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")

    # -- chat completions ---------------------------------------------------------------------

    async def chat_completions(self, body: p.ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.to_sampling_params(self.engine.vocab_size)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        tracker = RequestTracker(self.metrics)
        messages = body.template_messages()
        try:
            stream = await self.engine.add_chat_request(request_id, messages, params, self.max_waiting)
        except InvalidRequestError as exc:
            raise body.translate_error(exc) from exc
        if body.stream:
            return _event_stream(self._chat_events(request, body, params.n, stream, tracker))
        async with _abort_on_exit(request, [stream]):
            final = None
            async for output in stream:
                tracker.observe(output)
                final = output
        if final is None or not final.finished:
            raise APIError(499, "the client disconnected")  # nobody is left to read this
        choices = [
            p.ChatChoice(
                index=choice.index,
                message=p.AssistantMessage(content=choice.text),
                logprobs=p.chat_logprobs(choice.logprobs or [], self._decode_token)
                if body.logprobs
                else None,
                finish_reason=choice.finish_reason,
            )
            for choice in final.outputs
        ]
        response = p.ChatCompletionResponse(
            id=request_id, model=body.model, choices=choices, usage=_usage([final])
        )
        return _json(response)

    async def _chat_events(
        self,
        request: Request,
        body: p.ChatCompletionRequest,
        n: int,
        stream: RequestStream,
        tracker: RequestTracker,
    ) -> AsyncIterator[str]:
        created = p.now()

        def chunk(choices: list[p.ChatChunkChoice], usage: p.Usage | None = None) -> str:
            return _event(
                p.ChatCompletionChunk(
                    id=stream.request_id, created=created, model=body.model, choices=choices, usage=usage
                )
            )

        def choice_chunk(index: int, delta: dict[str, str], **fields: Any) -> str:
            return chunk([p.ChatChunkChoice(index=index, delta=delta, **fields)])

        async with _abort_on_exit(request, [stream]):
            try:
                yield chunk(
                    [p.ChatChunkChoice(index=i, delta={"role": "assistant", "content": ""}) for i in range(n)]
                )
                final = None
                finished: set[int] = set()  # choices whose last chunk went out
                async for output in stream:
                    tracker.observe(output)
                    final = output
                    for choice in output.outputs:
                        if choice.delta_text or (body.logprobs and choice.delta_token_ids):
                            logprobs = None
                            if body.logprobs:
                                logprobs = p.chat_logprobs(_new_logprobs(choice), self._decode_token)
                            yield choice_chunk(
                                choice.index, {"content": choice.delta_text}, logprobs=logprobs
                            )
                        if choice.finish_reason is not None and choice.index not in finished:
                            finished.add(choice.index)
                            yield choice_chunk(choice.index, {}, finish_reason=choice.finish_reason)
                if stream.aborted:
                    return
                if final is not None and body.include_usage:
                    yield chunk([], usage=_usage([final]))
            except Exception as exc:
                yield _error_event(exc)
            yield DONE_EVENT

    # -- text completions ---------------------------------------------------------------------

    async def completions(self, body: p.CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.to_sampling_params(self.engine.vocab_size)
        prompts = body.prompts()
        request_id = f"cmpl-{uuid.uuid4().hex}"
        trackers = [RequestTracker(self.metrics) for _ in prompts]
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(await self.engine.add_request(engine_id, prompt, params, self.max_waiting))
        except BaseException:
            for stream in streams:  # all prompts run, or none
                stream.close()
            raise
        echoes = [""] * len(prompts)
        if body.echo:
            echoes = [
                prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt) for prompt in prompts
            ]
        if body.stream:
            return _event_stream(
                self._completion_events(request, request_id, body, params.n, streams, trackers, echoes)
            )

        finals: list[RequestOutput | None] = [None] * len(streams)
        async with _abort_on_exit(request, streams):
            async for i, output in _merge(streams):
                trackers[i].observe(output)
                finals[i] = output
        done = [final for final in finals if final is not None and final.finished]
        if len(done) < len(streams):
            raise APIError(499, "the client disconnected")  # nobody is left to read this
        choices = []
        for i, final in enumerate(done):
            for choice in final.outputs:
                logprobs = None
                if body.logprobs is not None:
                    tokens = _prompt_logprobs(final) if body.echo else []
                    tokens += [(lp.token_id, lp) for lp in choice.logprobs or []]
                    logprobs = p.completion_logprobs(tokens, self._decode_token, 0)
                choices.append(
                    p.CompletionChoice(
                        index=i * params.n + choice.index,
                        text=echoes[i] + choice.text,
                        logprobs=logprobs,
                        finish_reason=choice.finish_reason,
                    )
                )
        return _json(
            p.CompletionResponse(id=request_id, model=body.model, choices=choices, usage=_usage(done))
        )

    async def _completion_events(
        self,
        request: Request,
        request_id: str,
        body: p.CompletionRequest,
        n: int,
        streams: list[RequestStream],
        trackers: list[RequestTracker],
        echoes: list[str],
    ) -> AsyncIterator[str]:
        created = p.now()
        finals: list[RequestOutput | None] = [None] * len(streams)
        finished: set[int] = set()  # choices whose last chunk went out
        text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts

        def chunk(choices: list[p.CompletionChoice], usage: p.Usage | None = None) -> str:
            response = p.CompletionResponse(
                id=request_id, created=created, model=body.model, choices=choices, usage=usage
            )
            return _event(response)

        async with _abort_on_exit(request, streams):
            try:
                async for i, output in _merge(streams):
                    trackers[i].observe(output)
                    first, finals[i] = finals[i] is None, output
                    for choice in output.outputs:
                        index = i * n + choice.index
                        text, tokens = choice.delta_text, []
                        if first:  # the echo goes first
                            text = echoes[i] + text
                            if body.echo and body.logprobs is not None:
                                tokens = _prompt_logprobs(output)
                        tokens += [(lp.token_id, lp) for lp in _new_logprobs(choice)]
                        if text or tokens:
                            logprobs = None
                            if body.logprobs is not None:
                                offset = text_offsets.get(index, 0)
                                logprobs = p.completion_logprobs(tokens, self._decode_token, offset)
                                text_offsets[index] = offset + sum(len(token) for token in logprobs.tokens)
                            yield chunk([p.CompletionChoice(index=index, text=text, logprobs=logprobs)])
                        if choice.finish_reason is not None and index not in finished:
                            finished.add(index)
                            yield chunk(
                                [p.CompletionChoice(index=index, text="", finish_reason=choice.finish_reason)]
                            )
                if any(stream.aborted for stream in streams):
                    return
                if body.include_usage:
                    yield chunk([], usage=_usage([final for final in finals if final is not None]))
            except Exception as exc:
                yield _error_event(exc)
            yield DONE_EVENT

    # -- everything else ----------------------------------------------------------------------

    async def models(self) -> Response:
        card = p.ModelCard(
            id=self.model_name,
            root=str(self.engine.engine.model_info.path),
            max_model_len=self.engine.max_model_len,
        )
        return _json(p.ModelList(data=[card]))

    async def tokenize(self, body: p.TokenizeRequest) -> Response:
        self._check_model(body.model)
        if body.prompt is not None and body.messages is None:
            tokens = await self.engine.encode(body.prompt)
        elif body.messages is not None and body.prompt is None:
            tokens = await self.engine.encode_chat([message.to_template() for message in body.messages])
        else:
            raise InvalidRequestError("prompt: give either prompt or messages", "prompt")
        return _json(
            p.TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.engine.max_model_len)
        )

    async def detokenize(self, body: p.DetokenizeRequest) -> Response:
        self._check_model(body.model)
        vocab_size = self.engine.vocab_size
        if any(not 0 <= token < vocab_size for token in body.tokens):
            raise InvalidRequestError(f"tokens: must be token ids in [0, {vocab_size})", "tokens")
        return _json(p.DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens)))

    async def health(self) -> Response:
        if not self.engine.is_running:
            raise APIError(503, "the engine is not running", type="server_error", code="engine_stopped")
        return Response(status_code=200)

    async def version(self) -> dict[str, str]:
        return {"version": yaie.__version__}

    async def prometheus_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)


def build_app(
    async_engine: AsyncEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting: int | None = None,
) -> FastAPI:
    """The API for `async_engine`, which the caller starts and shuts down.

    `max_waiting`: answer 429 while this many sequences already wait for admission.
    """
    server = OpenAIServer(async_engine, served_model_name, max_waiting)
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


def _usage(finals: Sequence[RequestOutput]) -> p.Usage:
    return p.Usage.of(
        prompt_tokens=sum(len(final.prompt_token_ids) for final in finals),
        completion_tokens=sum(len(choice.token_ids) for final in finals for choice in final.outputs),
        cached_tokens=sum(final.num_cached_tokens for final in finals),
    )


def _new_logprobs(choice: CompletionOutput) -> list[TokenLogprob]:
    """The logprobs of the tokens this output added to the choice."""
    num_tokens = len(choice.token_ids)
    return (choice.logprobs or [])[num_tokens - len(choice.delta_token_ids) : num_tokens]


def _prompt_logprobs(output: RequestOutput) -> list[tuple[int, TokenLogprob | None]]:
    """(token id, logprob) for each prompt token, for echo with logprobs."""
    if output.prompt_logprobs is None:
        raise InvalidRequestError("echo: echo together with logprobs is not supported yet", "echo")
    return list(zip(output.prompt_token_ids, output.prompt_logprobs, strict=True))


def _error_event(exc: Exception) -> str:
    error = api_error(exc)
    if error.status == 500:
        logger.error("a streamed request failed", exc_info=exc)
    return _event(p.ErrorResponse(error=error.info))
