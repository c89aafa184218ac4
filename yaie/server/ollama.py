"""Ollama's API over the served model, for Open WebUI, editors and the `ollama` client:
/api/chat and /api/generate (streamed as NDJSON, one JSON object per line, by default; whole
when `stream` is false), /api/embed and /api/embeddings, /api/tags, /api/ps, /api/show and
/api/version.

A chat request becomes the chat completion request it asks for, and a generate request the text
completion of its prompt's tokens (ollama_protocol.py), so both take the same path to a prompt,
SamplingParams, tool grammar and engine requests as the OpenAI endpoints. Errors come back in
Ollama's shape, `{"error": "message"}`: 400 for a bad request, 404 for an unknown model; inside a
stream, which has already answered 200, as one last line of that shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

import yaie
from yaie.errors import InvalidRequestError
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams
from yaie.server import ollama_protocol as o
from yaie.server.errors import APIError, ClientDisconnected, api_error
from yaie.server.reasoning import ReasoningSplitter, Split
from yaie.server.streaming import Generation, Update
from yaie.structured import tools
from yaie.structured.tool_formats import ToolCallSplitter
from yaie.structured.tools import ToolCall

if TYPE_CHECKING:
    from yaie.server.app import OpenAIServer

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


class OllamaReply:
    """The reply to one chat or generate request: NDJSON chunks, or the whole of it."""

    def __init__(
        self,
        model: str,
        chat: bool,
        parser: ToolCallSplitter | None,
        arrival_ns: int,
        splitter: ReasoningSplitter | None = None,
        shows_thinking: bool = False,
    ) -> None:
        self.model = model  # as the request named it, as Ollama echoes it
        self.chat = chat  # chat replies carry `message`, generate replies `response`
        self.parser = parser  # with tools, splits the calls out of the text
        self.splitter = splitter  # with a reasoning parser, splits the reasoning off first
        self.shows_thinking = shows_thinking  # the reasoning is sent (`think` not false)
        self.arrival_ns = arrival_ns
        self.first_token_ns: int | None = None

    async def _pieces(
        self, generation: Generation
    ) -> AsyncGenerator[tuple[str, str, list[ToolCall], Update], None]:
        """(new thinking, new content, new calls, the update) as the tokens come."""
        async with contextlib.aclosing(generation.updates()) as updates:
            async for update in updates:
                choice = update.choice
                finished = update.finish_reason is not None
                if self.first_token_ns is None and choice.token_ids:
                    self.first_token_ns = time.perf_counter_ns()
                split = Split(content=choice.delta_text)
                if self.splitter is not None:
                    split = self.splitter.feed(choice.delta_text)
                    split += self.splitter.finish() if finished else Split()
                content, calls = split.content, []
                if self.parser is not None:
                    events = self.parser.feed(split.content)
                    if finished:
                        events += self.parser.finish()
                    content = "".join(value for kind, value in events if kind == "content")
                    calls = [value for kind, value in events if kind == "call"]
                yield split.reasoning if self.shows_thinking else "", content, calls, update

    async def chunks(self, generation: Generation) -> AsyncGenerator[o.Chunk, None]:
        """Each piece of thinking, content or call as it comes, then the last chunk with the counts."""
        async with contextlib.aclosing(self._pieces(generation)) as pieces:
            async for thinking, content, calls, update in pieces:
                if thinking or content or calls:
                    yield self._chunk(content, calls, thinking)
                if update.finish_reason is not None:
                    yield self._final(update, "", [], "")

    async def whole(self, generation: Generation) -> o.Chunk:
        thoughts: list[str] = []
        contents: list[str] = []
        all_calls: list[ToolCall] = []
        last: Update | None = None
        async with contextlib.aclosing(self._pieces(generation)) as pieces:
            async for thinking, content, calls, update in pieces:
                thoughts.append(thinking)
                contents.append(content)
                all_calls += calls
                last = update
        assert last is not None and last.finish_reason is not None, "a request ends with its finish"
        return self._final(last, "".join(contents), all_calls, "".join(thoughts))

    def _chunk(self, content: str, calls: list[ToolCall], thinking: str, **final: Any) -> o.Chunk:
        message, response = None, None
        if self.chat:
            tool_calls = [
                o.ToolCallOut(
                    function=o.FunctionCallOut(name=call.name, arguments=o.call_arguments(call.arguments))
                )
                for call in calls
            ]
            message = o.MessageOut(content=content, thinking=thinking or None, tool_calls=tool_calls or None)
        else:
            response = content
        return o.Chunk(
            model=self.model, created_at=o.timestamp(), message=message, response=response,
            thinking=None if self.chat or not thinking else thinking, done=bool(final), **final,
        )  # fmt: skip

    def _final(self, update: Update, content: str, calls: list[ToolCall], thinking: str) -> o.Chunk:
        end = time.perf_counter_ns()
        first = self.first_token_ns or end
        output, choice = update.output, update.choice
        context = None if self.chat else output.prompt_token_ids + choice.token_ids
        return self._chunk(
            content, calls, thinking, done_reason=update.finish_reason, context=context,
            total_duration=end - self.arrival_ns, load_duration=0,
            prompt_eval_count=len(output.prompt_token_ids), prompt_eval_duration=first - self.arrival_ns,
            eval_count=len(choice.token_ids), eval_duration=end - first,
        )  # fmt: skip


def ollama_error(exc: Exception) -> APIError:
    """The APIError that tells a client about `exc`, naming the Ollama request's fields."""
    error = api_error(o.translate_error(exc) if isinstance(exc, InvalidRequestError) else exc)
    if error.status >= 500:
        logger.error("an Ollama API request failed", exc_info=exc)
    return error


def error_response(exc: Exception) -> JSONResponse:
    """`exc` as Ollama reports errors: `{"error": message}` with the status it calls for."""
    error = ollama_error(exc)
    return JSONResponse({"error": error.info.message}, status_code=error.status, headers=error.headers)


def ndjson(chunks: AsyncGenerator[o.Chunk, None]) -> StreamingResponse:
    """`chunks` as a 200 response of JSON lines."""
    return StreamingResponse(_lines(chunks), media_type="application/x-ndjson")


async def _lines(chunks: AsyncGenerator[o.Chunk, None]) -> AsyncIterator[str]:
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk.line()
        except ClientDisconnected:
            return  # nobody is left to read the rest
        except Exception as exc:
            yield json.dumps({"error": ollama_error(exc).info.message}) + "\n"


class OllamaAPI:
    """The endpoints' logic over the OpenAI server's checks and engine; `build_app` routes to it."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.engine = server.engine
        self.listed_name, self.names = o.model_names(server.model_name)
        self.chat_template: str = getattr(server.tokenizer, "chat_template", None) or ""
        self.entry = self._entry()

    def _entry(self) -> o.ModelEntry:
        info = self.engine.model_info
        path = Path(info.path)
        family = info.architecture.removesuffix("ForCausalLM").lower()
        details = o.ModelDetails(
            format="gguf" if path.suffix == ".gguf" else "safetensors",
            family=family,
            families=[family],
            quantization_level=None if info.quantization == "none" else info.quantization,
        )
        return o.ModelEntry(
            name=self.listed_name,
            model=self.listed_name,
            modified_at=_rfc3339(path.stat().st_mtime),
            size=info.weight_bytes,
            digest=_weights_digest(path),
            details=details,
        )

    def _check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(404, f"model {name!r} not found; this server serves {self.listed_name!r}")

    async def _answer(self, handler: Callable[[], Awaitable[Response]]) -> Response:
        try:
            return await handler()
        except Exception as exc:
            return error_response(exc)

    def _fill_context(
        self, body: o.GenerationRequest, params: SamplingParams, prompt: list[int]
    ) -> SamplingParams:
        """num_predict -1: as many tokens as the context has room for after the prompt."""
        if not body.fills_context:
            return params
        # A prompt that leaves no room is the engine's error to report, so give it something.
        return dataclasses.replace(params, max_tokens=max(1, self.engine.max_model_len - len(prompt)))

    def _loaded(self, body: o.GenerationRequest, chat: bool) -> Response:
        """Ollama's answer to a request with nothing to generate: the model is loaded."""
        message = o.MessageOut(content="") if chat else None
        chunk = o.Chunk(
            model=body.model, created_at=o.timestamp(), message=message, response=None if chat else "",
            done=True, done_reason="load",
        )  # fmt: skip
        return _json(chunk)

    def _reasoning(
        self, body: o.GenerationRequest, prompt: list[int], params: SamplingParams
    ) -> tuple[ReasoningSplitter | None, bool]:
        """The reply's reasoning splitter (None without a reasoning parser), and whether its
        thinking is shown: unless `think` is false, as Ollama shows a thinking model's thoughts."""
        in_reasoning = self.server.starts_in_reasoning(prompt, params)
        splitter = None if in_reasoning is None else ReasoningSplitter(in_reasoning)
        return splitter, body.thinks is not False

    async def chat(self, request: Request) -> Response:
        return await self._answer(lambda: self._chat(request))

    async def _chat(self, request: Request) -> Response:
        arrival = time.perf_counter_ns()
        body: o.ChatRequest = o.parse(o.ChatRequest, await _body(request))
        self._check_model(body.model)
        body.check(splits_thinking=self.server.reasoning_parser is not None)
        if not body.messages:
            return self._loaded(body, chat=True)
        chat = body.to_openai()
        server = self.server
        params = chat.to_sampling_params(server.tool_format, server.defaults.sampling)
        messages = chat.template_messages()
        server._check_chars([message["content"] for message in messages], "messages")
        prompt = await self.engine.encode_chat(messages, chat.tool_definitions, chat.chat_template_kwargs)
        params = self._fill_context(body, params, prompt)
        generation = await server._start(request, chat, params, [(f"ollama-chat-{uuid.uuid4().hex}", prompt)])
        parser = server.tool_format.parser(chat.tool_names) if chat.calls_tools else None
        reply = OllamaReply(body.model, True, parser, arrival, *self._reasoning(body, prompt, params))
        if body.streams:
            return ndjson(reply.chunks(generation))
        return _json(await reply.whole(generation))

    async def generate(self, request: Request) -> Response:
        return await self._answer(lambda: self._generate(request))

    async def _generate(self, request: Request) -> Response:
        arrival = time.perf_counter_ns()
        body: o.GenerateRequest = o.parse(o.GenerateRequest, await _body(request))
        self._check_model(body.model)
        body.check(splits_thinking=self.server.reasoning_parser is not None)
        if not body.prompt and body.system is None and body.template is None:
            return self._loaded(body, chat=False)
        server = self.server
        templated = body.templated()
        if body.raw or templated is not None:
            text = body.prompt if templated is None else templated
            server._check_chars([text], "prompt")
            prompt = await self.engine.encode(text)
        else:
            messages = [{"role": "system", "content": body.system}] if body.system is not None else []
            messages.append({"role": "user", "content": body.prompt})
            server._check_chars([message["content"] for message in messages], "prompt")
            prompt = await self.engine.encode_chat(messages, chat_template_kwargs=body.template_kwargs)
        if body.context:
            vocab_size = self.engine.vocab_size
            if not 0 <= min(body.context) <= max(body.context) < vocab_size:
                raise InvalidRequestError(f"context: must be token ids in [0, {vocab_size})", "context")
            prompt = body.context + prompt
        completion = body.to_openai(prompt)
        params = self._fill_context(body, completion.to_sampling_params(server.defaults.sampling), prompt)
        generation = await server._start(
            request, completion, params, [(f"ollama-generate-{uuid.uuid4().hex}", prompt)]
        )
        reply = OllamaReply(body.model, False, None, arrival, *self._reasoning(body, prompt, params))
        if body.streams:
            return ndjson(reply.chunks(generation))
        return _json(await reply.whole(generation))

    async def embed(self, request: Request) -> Response:
        return await self._answer(lambda: self._embed(request))

    async def _embed(self, request: Request) -> Response:
        arrival = time.perf_counter_ns()
        body: o.EmbedRequest = o.parse(o.EmbedRequest, await _body(request))
        self._check_model(body.model)
        size = self.engine.model_info.hidden_size
        if body.dimensions is not None and body.dimensions != size:
            raise InvalidRequestError(
                f"dimensions: this model's embeddings have {size} dimensions and cannot be shortened",
                "dimensions",
            )
        inputs = body.inputs()
        if not inputs:
            return _json(o.EmbedResponse(model=body.model, embeddings=[]))
        embedded = await self.server._embed(request, inputs, PoolingParams(), "input", truncate=body.truncate)
        return _json(
            o.EmbedResponse(
                model=body.model,
                embeddings=embedded.vectors,
                total_duration=time.perf_counter_ns() - arrival,
                load_duration=0,
                prompt_eval_count=embedded.num_tokens,
            )
        )

    async def embeddings(self, request: Request) -> Response:
        return await self._answer(lambda: self._embeddings(request))

    async def _embeddings(self, request: Request) -> Response:
        body: o.EmbeddingsRequest = o.parse(o.EmbeddingsRequest, await _body(request))
        self._check_model(body.model)
        if not body.prompt:
            return _json(o.EmbeddingResponse(embedding=[]))
        params = PoolingParams(normalize=False)
        embedded = await self.server._embed(request, [body.prompt], params, "prompt", truncate=True)
        return _json(o.EmbeddingResponse(embedding=embedded.vectors[0]))

    async def tags(self) -> Response:
        return _json(o.ModelList(models=[self.entry]))

    async def ps(self) -> Response:
        """The served model, always loaded: it stays until the server stops."""
        running = self.entry.model_copy(update={"context_length": self.engine.max_model_len})
        return _json(o.ModelList(models=[running]))

    async def show(self, request: Request) -> Response:
        return await self._answer(lambda: self._show(request))

    async def _show(self, request: Request) -> Response:
        body: o.ShowRequest = o.parse(o.ShowRequest, await _body(request))
        name = body.model if body.model is not None else body.name
        if name is None:
            raise InvalidRequestError("model: missing required parameter", "model")
        self._check_model(name)
        family = self.entry.details.family
        capabilities = ["completion"] + (["tools"] if tools.template_knows_tools(self.chat_template) else [])
        return _json(
            o.ShowResponse(
                modified_at=self.entry.modified_at,
                template=self.chat_template,
                parameters=o.parameters_text(self.server.defaults.sampling),
                details=self.entry.details,
                model_info={
                    "general.architecture": family,
                    f"{family}.context_length": self.engine.max_model_len,
                    f"{family}.vocab_size": self.engine.vocab_size,
                },
                capabilities=capabilities,
            )
        )

    async def version(self) -> Response:
        return JSONResponse({"version": yaie.__version__})


async def _body(request: Request) -> object:
    try:
        return json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the body is not valid JSON: {exc}") from exc


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(exclude_none=True), media_type="application/json")


def _rfc3339(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _weights_digest(path: Path) -> str:
    """ "sha256:" over the weight files' names, sizes and modification times: it names these
    weights (it changes when they do) without reading gigabytes to hash their contents."""
    files = [path] if path.is_file() else sorted(f for f in path.iterdir() if f.suffix in WEIGHT_SUFFIXES)
    identity = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return "sha256:" + hashlib.sha256(json.dumps(identity).encode()).hexdigest()
