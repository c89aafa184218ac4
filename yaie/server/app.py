"""The OpenAI-compatible HTTP API over an AsyncEngine: its routes, and the checks each request
passes before any work is done for it.

The parts, each in its own module: errors.py (every failure as OpenAI's error body),
middleware.py (the API key, the body's size), streaming.py (following a call's engine requests,
server-sent events), and one response builder per completion endpoint (chat_completions.py,
completions.py), which streams deltas or builds the whole response from the finished outputs.
Ollama's API (/api/*) is ollama.py's, over the same checks and engine requests.

A request may leave out "model": there is one, the served model. Sampling fields it leaves out
take the model's generation_config.json defaults (yaie/generation_config.py) unless the server
was built with generation_config="vllm".
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

import yaie
from yaie import generation_config
from yaie.config import GENERATION_CONFIGS
from yaie.engine.async_engine import Admission, AsyncEngine
from yaie.errors import InvalidRequestError
from yaie.outputs import RequestOutput
from yaie.pooling_params import PoolingParams
from yaie.sampling_params import SamplingParams
from yaie.server import anthropic_protocol as anthropic
from yaie.server import protocol as p
from yaie.server import responses_protocol as rp
from yaie.server.anthropic_messages import ANTHROPIC_EVENTS, AnthropicMessage
from yaie.server.chat_completions import ChatCompletion
from yaie.server.completions import Completion
from yaie.server.errors import APIError, add_error_handlers, model_not_found
from yaie.server.metrics import RequestTracker, ServerMetrics
from yaie.server.middleware import LimitRequestBytes, RequireAPIKey, tenant_of
from yaie.server.ollama import OllamaAPI
from yaie.server.reasoning import PROMPT_TAIL_TOKENS, ReasoningParser
from yaie.server.responses import ResponseBuilder, ResponseStore
from yaie.server.streaming import OPENAI_EVENTS, Generation, event_stream
from yaie.server.web import PAGE_PATHS, web_router
from yaie.structured import tool_formats

logger = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics"}) | PAGE_PATHS  # open even with an API key


@dataclass(frozen=True)
class ServerLimits:
    """What one request may ask of the server, each checked before any work is done for it."""

    max_waiting: int | None = None  # 429 while this many sequences already wait for admission
    # 429 for a tenant (an API key's) while this many of its sequences wait; None: an equal share
    # of max_waiting per tenant, so a tenant's flood never fills the queue for the others.
    max_waiting_per_tenant: int | None = None
    max_request_bytes: int = 8 * 2**20  # 413 for a bigger body
    max_seqs_per_request: int = 256  # prompts x n; 400 beyond (--max-seqs-per-request)
    # When a request leaves max_tokens out. vLLM's default is the rest of the context, which lets
    # one careless request hold a sequence (and its KV cache) for thousands of steps; ours is a
    # bound of its own, cut to the room the prompt leaves (and to the model's max_new_tokens).
    default_max_tokens: int = 2048
    # Seconds after which a request that sets no `timeout` of its own ends with finish_reason
    # "timeout" (--request-timeout); None: no deadline.
    request_timeout: float | None = None


# A prompt longer than this many characters per token of context cannot fit, whatever it says
# (tokens average about 4 characters), so it is refused before anyone pays to tokenize it.
MAX_CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Embedded:
    """What a call's pooling requests made: one vector per input, and the tokens they read."""

    vectors: list[list[float]]
    num_tokens: int


class OpenAIServer:
    """The endpoints' logic; `build_app` routes to it."""

    def __init__(
        self,
        async_engine: AsyncEngine,
        served_model_name: str,
        limits: ServerLimits,
        defaults: generation_config.GenerationDefaults,
        reasoning_parser: ReasoningParser | None = None,
        num_tenants: int = 1,
    ) -> None:
        """`num_tenants`: how many tenants the API keys name (1 without keys)."""
        self.engine = async_engine
        self.reasoning_parser = reasoning_parser
        self.model_name = served_model_name
        self.limits = limits
        self.max_waiting_per_tenant = limits.max_waiting_per_tenant
        if self.max_waiting_per_tenant is None and limits.max_waiting is not None:
            # The shares add up to max_waiting: a tenant within its share is never refused
            # because of what the others queued.
            self.max_waiting_per_tenant = max(1, limits.max_waiting // num_tenants)
        self.defaults = defaults
        self.tokenizer = async_engine.tokenizer
        self.tool_format = tool_formats.for_template(getattr(self.tokenizer, "chat_template", None))
        self.metrics = ServerMetrics(async_engine.stats)
        self.max_prompt_chars = async_engine.max_model_len * MAX_CHARS_PER_TOKEN
        # What /v1/responses stores, for previous_response_id: a store per tenant, so that one
        # can neither read another's responses nor push them out of a shared store.
        self._response_stores: dict[str, ResponseStore] = {}
        # One card, made at start: `created` is when the model was loaded, the same on every call.
        self.model_card = p.ModelCard(
            id=served_model_name, root=str(async_engine.model_path), max_model_len=async_engine.max_model_len
        )

    def _check_chars(self, texts: Sequence[str], param: str) -> None:
        if sum(len(text) for text in texts) > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param}: longer than the {self.max_prompt_chars} characters that could fit this "
                f"model's context of {self.engine.max_model_len} tokens",
                param,
            )

    def _check_num_seqs(self, num_prompts: int, n: int, param: str = "n") -> None:
        """A 400 naming the limit when `num_prompts` x `n` sequences are more than one request may
        run, or than could ever wait at once (they would be refused with a 429 forever)."""
        limits = [(self.limits.max_seqs_per_request, "--max-seqs-per-request")]
        if self.max_waiting_per_tenant is not None:
            limits.append((self.max_waiting_per_tenant, "--max-waiting-per-tenant"))
        if self.limits.max_waiting is not None:
            limits.append((self.limits.max_waiting, "--max-waiting"))
        limit, option = min(limits)
        if num_prompts * n > limit:
            raise InvalidRequestError(
                f"{param}: {num_prompts} prompt(s) x n={n} is {num_prompts * n} sequences, more than "
                f"the {limit} one request may run on this server ({option})",
                param,
            )

    def _admission(self, request: Request) -> Admission:
        return Admission(tenant_of(request), self.limits.max_waiting, self.max_waiting_per_tenant)

    def responses(self, request: Request) -> ResponseStore:
        """The stored responses of the request's tenant."""
        return self._response_stores.setdefault(tenant_of(request), ResponseStore())

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise model_not_found(name)

    def _with_default_max_tokens(
        self, params: SamplingParams, prompts: Sequence[list[int]]
    ) -> SamplingParams:
        if params.max_tokens is not None:
            return params
        room = self.engine.max_model_len - max(len(prompt) for prompt in prompts)
        limit = self.limits.default_max_tokens
        if self.defaults.max_tokens is not None:
            limit = min(limit, self.defaults.max_tokens)
        # A prompt that leaves no room is the engine's error to report, so give it something.
        return dataclasses.replace(params, max_tokens=max(1, min(limit, room)))

    def starts_in_reasoning(self, prompt: list[int], params: SamplingParams) -> bool | None:
        """Whether the output to `prompt` starts in reasoning (reasoning.py); None without a
        reasoning parser, when the output is not split."""
        if self.reasoning_parser is None:
            return None
        tail = self.tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:])
        return self.reasoning_parser.starts_in_reasoning(tail, params.structured_outputs is not None)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])  # type: ignore[no-any-return]

    async def _start(
        self,
        request: Request,
        body: p.SamplingRequest,
        params: SamplingParams,
        requests: Sequence[tuple[str, list[int]]],
        translate_error: Callable[[InvalidRequestError], InvalidRequestError] | None = None,
    ) -> Generation:
        """Add one engine request per (id, prompt token ids): all of them, or none. The engine's
        refusals, at admission or while the requests run, name the fields of `body`'s API
        (`translate_error`, by default `body`'s own)."""
        translate = translate_error or body.translate_error
        trackers = [RequestTracker(self.metrics) for _ in requests]  # their clocks start on arrival
        params = self._with_default_max_tokens(params, [prompt for _, prompt in requests])
        timeout = body.timeout if body.timeout is not None else self.limits.request_timeout
        try:
            streams = await self.engine.add_requests(
                requests, params, self._admission(request), priority=body.priority or 0, timeout=timeout,
                cache_salt=body.cache_salt,
            )  # fmt: skip
        except InvalidRequestError as exc:
            raise translate(exc) from exc
        return Generation(request, streams, trackers, params.n, self.metrics, translate)

    async def chat_completions(self, body: p.ChatCompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.to_sampling_params(self.tool_format, self.defaults.sampling)
        self._check_num_seqs(1, params.n)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        messages = body.template_messages()
        self._check_chars([message["content"] for message in messages], "messages")
        prompt = await self.engine.encode_chat(messages, body.tool_definitions, body.chat_template_kwargs)
        generation = await self._start(request, body, params, [(request_id, prompt)])
        completion = ChatCompletion(
            request_id, self.model_name, body, self.tool_format, self._decode_token,
            self.starts_in_reasoning(prompt, params),
        )  # fmt: skip
        if body.stream:
            return event_stream(completion.chunks(generation), OPENAI_EVENTS)
        finals = await generation.final_outputs()
        return _json(completion.response(finals, generation.usage()))

    async def completions(self, body: p.CompletionRequest, request: Request) -> Response:
        self._check_model(body.model)
        params = body.to_sampling_params(self.defaults.sampling)
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
        completion = Completion(
            request_id, self.model_name, body, prompts, self.engine.decode, self._decode_token
        )
        if body.stream:
            return event_stream(completion.chunks(generation), OPENAI_EVENTS)
        finals = await generation.final_outputs()
        return _json(await completion.response(finals, generation.usage()))

    async def embeddings(self, body: p.EmbeddingRequest, request: Request) -> Response:
        """One vector per input from the served model (pooling: yaie/pooling_params.py)."""
        self._check_model(body.model)
        body.check_dimensions(self.engine.model_info.hidden_size)
        prompts = body.prompts()
        embedded = await self._embed(request, prompts, PoolingParams(normalize=body.normalize), "input")
        data = [
            p.Embedding(index=i, embedding=p.encode_embedding(vector, body.encoding_format))
            for i, vector in enumerate(embedded.vectors)
        ]
        usage = p.EmbeddingUsage(prompt_tokens=embedded.num_tokens, total_tokens=embedded.num_tokens)
        return _json(p.EmbeddingResponse(data=data, model=self.model_name, usage=usage))

    async def _embed(
        self,
        request: Request,
        prompts: Sequence[str | list[int]],
        params: PoolingParams,
        param: str,
        truncate: bool = False,
    ) -> Embedded:
        """Pooling requests for `prompts` (texts or token ids), batched through the engine with
        everyone else's; their vectors, in order. `param`: the request's field, for errors;
        `truncate`: cut inputs longer than the context to fit (Ollama's), else refuse them."""
        names = [param if len(prompts) == 1 else f"{param}[{i}]" for i in range(len(prompts))]
        self._check_num_seqs(len(prompts), 1, param)
        for name, prompt in zip(names, prompts, strict=True):
            if isinstance(prompt, str):
                self._check_chars([prompt], name)
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        encoded = iter(await asyncio.gather(*(self.engine.encode(text) for text in texts)))
        token_ids = [next(encoded) if isinstance(prompt, str) else prompt for prompt in prompts]
        context, vocab_size = self.engine.max_model_len, self.engine.vocab_size
        for i, (name, ids) in enumerate(zip(names, token_ids, strict=True)):
            if not ids:
                raise InvalidRequestError(f"{name}: must not be empty", name)
            if not 0 <= min(ids) <= max(ids) < vocab_size:
                raise InvalidRequestError(f"{name}: token ids must be in [0, {vocab_size})", name)
            if len(ids) > context and truncate:
                token_ids[i] = ids[:context]
            elif len(ids) > context:
                raise InvalidRequestError(
                    f"{name}: {len(ids)} tokens, more than this model's context of {context}", name
                )
        request_id = f"embd-{uuid.uuid4().hex}"
        requests = [(f"{request_id}-{i}", ids) for i, ids in enumerate(token_ids)]
        trackers = [RequestTracker(self.metrics) for _ in requests]
        streams = await self.engine.add_requests(requests, params, self._admission(request))
        finals = await Generation(request, streams, trackers, 1, self.metrics).final_outputs()
        return Embedded(
            [_pooled(final) for final in finals], sum(len(final.prompt_token_ids) for final in finals)
        )

    # -- OpenAI's Responses API (responses.py) --

    async def create_response(self, request: Request) -> Response:
        # Parsed here rather than by FastAPI so that errors name the Responses API's fields.
        body = rp.ResponsesRequest.parse(await request.body())
        self._check_model(body.model)
        history: list[p.ChatMessage] = []
        if body.previous_response_id is not None:
            stored = self.responses(request).get(body.previous_response_id, "previous_response_id")
            history = stored.conversation
        chat = body.to_chat(history)
        params = chat.to_sampling_params(self.tool_format, self.defaults.sampling)
        messages = chat.template_messages()
        self._check_chars([message["content"] for message in messages], "input")
        response_id = f"resp_{uuid.uuid4().hex}"
        prompt = await self.engine.encode_chat(messages, chat.tool_definitions)
        generation = await self._start(request, chat, params, [(response_id, prompt)])
        store = self.responses(request)
        builder = ResponseBuilder(
            response_id, self.model_name, body, chat, params, history, self.tool_format, store
        )
        if body.stream:
            return event_stream(builder.events(generation), builder.event_format())
        finals = await generation.final_outputs()
        return _json(builder.response(finals, generation.usage()))

    async def get_response(self, response_id: str, request: Request) -> Response:
        return _json(self.responses(request).get(response_id).response)

    async def delete_response(self, response_id: str, request: Request) -> Response:
        self.responses(request).delete(response_id)
        return _json(rp.DeletedResponse(id=response_id))

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API, as the chat completion request it maps onto."""
        body = anthropic.parse(anthropic.MessagesRequest, await request.body())
        self._check_model(body.model)
        chat = body.to_chat()
        params = body.to_sampling_params(chat, self.tool_format, self.defaults.sampling)
        prompt = await self._encode_chat(chat)
        message_id = f"msg_{uuid.uuid4().hex}"
        generation = await self._start(
            request, chat, params, [(message_id, prompt)],
            lambda exc: anthropic.translate_error(chat.translate_error(exc)),
        )  # fmt: skip
        message = AnthropicMessage(
            message_id, self.model_name, chat, self.tool_format, self.starts_in_reasoning(prompt, params),
            body.thinks,
        )  # fmt: skip
        if body.stream:
            return event_stream(message.events(generation), ANTHROPIC_EVENTS)
        finals = await generation.final_outputs()
        return _json(message.response(finals, generation.usage()))

    async def count_tokens(self, request: Request) -> Response:
        """How many tokens a Messages request's prompt is (Anthropic's count_tokens)."""
        body = anthropic.parse(anthropic.CountTokensRequest, await request.body())
        self._check_model(body.model)
        prompt = await self._encode_chat(body.chat_request())
        return _json(anthropic.CountTokensResponse(input_tokens=len(prompt)))

    async def _encode_chat(self, chat: p.ChatCompletionRequest) -> list[int]:
        messages = chat.template_messages()
        self._check_chars([message["content"] for message in messages], "messages")
        return await self.engine.encode_chat(messages, chat.tool_definitions, chat.chat_template_kwargs)

    async def models(self) -> Response:
        return _json(p.ModelList(data=[self.model_card]))

    async def model(self, model_id: str) -> Response:
        """The served model's card, as /v1/models lists it; any other id is not found."""
        self._check_model(model_id)
        return _json(self.model_card)

    async def tokenize(self, body: p.TokenizeRequest) -> Response:
        self._check_model(body.model)
        if body.prompt is not None and body.messages is None:
            self._check_chars([body.prompt], "prompt")
            tokens = await self.engine.encode(body.prompt)
        elif body.messages is not None and body.prompt is None:
            messages = [message.to_template() for message in body.messages]
            self._check_chars([message["content"] for message in messages], "messages")
            tokens = await self.engine.encode_chat(messages, chat_template_kwargs=body.chat_template_kwargs)
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
    api_keys: Mapping[str, str] | None = None,
    limits: ServerLimits = ServerLimits(),
    generation_config_source: str = "auto",
    reasoning_parser: str | None = None,
) -> FastAPI:
    """The API for `async_engine`, which the caller starts and shuts down.

    `api_keys`: the keys that open the API, each to its tenant's name (several keys may share
    one); None: the API is open, and every request is the anonymous tenant's. Tenants share the
    engine fairly (yaie/engine/scheduler.py), each with its own share of the waiting queue, its
    own prefix cache, stored responses and view of the engine.

    `generation_config_source` is EngineConfig.generation_config: "auto" applies the model's
    generation_config.json defaults to requests that leave them out, "vllm" ignores the file.
    `reasoning_parser` (vLLM's `--reasoning-parser`: "deepseek_r1" or "qwen3") splits chat answers
    into reasoning and content (reasoning.py); None leaves them whole.
    """
    if generation_config_source not in GENERATION_CONFIGS:
        choices = ", ".join(GENERATION_CONFIGS)
        raise ValueError(f"generation_config must be one of {choices}; got {generation_config_source!r}")
    defaults = generation_config.GenerationDefaults()
    if generation_config_source == "auto":
        defaults = generation_config.load(Path(async_engine.model_path))
    logger.info("default sampling parameters: %s", defaults.describe())
    if limits.request_timeout is not None:
        logger.info("requests without a timeout of their own end after %g s", limits.request_timeout)
    parser = None if reasoning_parser is None else ReasoningParser(reasoning_parser)
    if api_keys is not None and (not api_keys or not all(api_keys)):
        raise ValueError("an API key must not be empty: that would let anyone in")
    num_tenants = len(set(api_keys.values())) if api_keys else 1
    server = OpenAIServer(async_engine, served_model_name, limits, defaults, parser, num_tenants)
    app = FastAPI(title="yaie", version=yaie.__version__)
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    # ":path": a served name may hold slashes (Qwen/Qwen3-0.6B), as the client sends it unescaped.
    app.add_api_route("/v1/models/{model_id:path}", server.model, methods=["GET"])
    app.add_api_route("/v1/embeddings", server.embeddings, methods=["POST"])
    app.add_api_route("/v1/responses", server.create_response, methods=["POST"])
    app.add_api_route("/v1/responses/{response_id}", server.get_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", server.delete_response, methods=["DELETE"])
    # Anthropic's Messages API; the bodies are parsed by the handlers, to answer in its error shape.
    app.add_api_route("/v1/messages", server.messages, methods=["POST"])
    app.add_api_route("/v1/messages/count_tokens", server.count_tokens, methods=["POST"])
    app.add_api_route("/tokenize", server.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", server.detokenize, methods=["POST"])
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/version", server.version, methods=["GET"])
    app.add_api_route("/metrics", server.prometheus_metrics, methods=["GET"])
    # Ollama's API (yaie/server/ollama.py), for Open WebUI, editors and the ollama client
    ollama = OllamaAPI(server)
    app.add_api_route("/api/chat", ollama.chat, methods=["POST"])
    app.add_api_route("/api/generate", ollama.generate, methods=["POST"])
    app.add_api_route("/api/embed", ollama.embed, methods=["POST"])
    app.add_api_route("/api/embeddings", ollama.embeddings, methods=["POST"])
    app.add_api_route("/api/tags", ollama.tags, methods=["GET"])
    app.add_api_route("/api/ps", ollama.ps, methods=["GET"])
    app.add_api_route("/api/show", ollama.show, methods=["POST"])
    app.add_api_route("/api/version", ollama.version, methods=["GET"])
    app.include_router(web_router(async_engine))
    add_error_handlers(app)
    # The last added runs first: the key is checked before the body is read.
    app.add_middleware(LimitRequestBytes, max_bytes=limits.max_request_bytes)
    if api_keys is not None:
        app.add_middleware(RequireAPIKey, tenants=api_keys, public_paths=PUBLIC_PATHS)
    return app


def _pooled(output: RequestOutput) -> list[float]:
    # A failed request ends its stream with an error instead, so a finished output has its vector.
    assert output.pooled is not None, "a pooling request's finished output carries its vector"
    return output.pooled.data


def _json(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")
