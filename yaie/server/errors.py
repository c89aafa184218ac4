"""Every failure as OpenAI's error body, with a status a client can act on.

`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (naming the field), 401
without the API key, 404 for an unknown model, 413 for a body too large, 429 when too many
requests wait, 500 when the engine fails on a request, 503 while shutting down. Inside an event
stream, which has already answered 200, a failure is sent as one last error event instead
(streaming.py).

Anthropic's routes (/v1/messages...) answer the same errors in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}` (anthropic_protocol.error_body), and Ollama's
(/api/...) in Ollama's, `{"error": "message"}`, since their clients read those.

A path no route serves is a 404, and a route asked with a method it does not take a 405 (with
`Allow`), each in the shape of the API its path belongs to, naming the method and path and
listing what this server serves: a client that reads only the message (langchain, pydantic-ai)
then shows something a user can act on instead of a bare "Not Found".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Receive, Scope, Send
from starlette.websockets import WebSocketClose

from yaie.engine.async_engine import EngineClosedError, EngineOverloadedError
from yaie.errors import InvalidRequestError, RequestFailedError, YaieError
from yaie.server import anthropic_protocol as anthropic
from yaie.server import protocol as p

RETRY_AFTER_SECONDS = 1  # what a 429 tells the client to wait


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

    def response(self, path: str = "") -> JSONResponse:
        """The error as the API serving `path` writes its errors (OpenAI's, unless another API's)."""
        return JSONResponse(self.body(path), status_code=self.status, headers=self.headers)

    def body(self, path: str = "") -> dict[str, Any]:
        if path.startswith(ANTHROPIC_PATHS):
            return anthropic.error_body(self.status, self.info.message)
        if path.startswith(OLLAMA_PATHS):
            return {"error": self.info.message}
        return p.ErrorResponse(error=self.info).model_dump()


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's Messages API: its clients read its error shape
OLLAMA_PATHS = "/api/"  # Ollama's API: its clients read `{"error": message}`
# The APIs this server speaks, by path prefix (the first that matches), for the 404's list.
API_FAMILIES = (
    (ANTHROPIC_PATHS, "Anthropic's Messages API"),
    ("/v1/", "OpenAI's API"),
    (OLLAMA_PATHS, "Ollama's API"),
)
FAMILY_ORDER = ("OpenAI's API", "Anthropic's Messages API", "Ollama's API")  # as the 404 lists them


class ClientDisconnected(APIError):
    """The client went away before its response was complete (its requests are aborted)."""

    def __init__(self) -> None:
        super().__init__(499, "the client disconnected")  # nobody is left to read this


def model_not_found(name: str) -> APIError:
    return APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")


def served_routes(app: FastAPI) -> str:
    """What `app` serves, API by API: "OpenAI's API (POST /v1/chat/completions, ...), ...". Read
    from its routes, so that it lists every endpoint there is (FastAPI's own /docs are left out)."""
    families: dict[str, list[str]] = {name: [] for name in FAMILY_ORDER}
    others: list[str] = []
    for route in app.routes:
        if not isinstance(route, APIRoute) or route.path.startswith("/static/"):
            continue
        entry = f"{'|'.join(sorted(route.methods or ()))} {route.path}"
        family = next((name for prefix, name in API_FAMILIES if route.path.startswith(prefix)), None)
        entries = others if family is None else families[family]
        if entry not in entries:
            entries.append(entry)
    parts = [f"{name} ({', '.join(entries)})" for name, entries in families.items() if entries]
    if others:
        parts.append(", ".join(others))
    return "; ".join(parts)


def unknown_route(app: FastAPI, method: str, path: str) -> APIError:
    """The 404 for a path no route of `app` serves."""
    hint = ""
    if any(isinstance(route, APIRoute) and route.path == f"/v1{path}" for route in app.routes):
        hint = f" (did you mean /v1{path}? an OpenAI client's base URL ends in /v1)"
    # OpenAI's own answer starts "Invalid URL (GET /v1/x)"; its code is null, as here.
    message = f"Invalid URL ({method} {path}): no such route{hint}. This server serves {served_routes(app)}"
    return APIError(404, message)


def method_not_allowed(request: Request) -> APIError:
    """The 405 for a path asked with a method none of its routes takes."""
    # Starlette's Allow names the first route on the path; a path may have one route per method.
    methods: set[str] = set()
    for route in request.app.routes:
        if isinstance(route, APIRoute) and route.matches(request.scope)[0] == Match.PARTIAL:
            methods |= route.methods or set()
    method, path, allowed = request.method, request.url.path, ", ".join(sorted(methods))
    message = f"Method not allowed ({method} {path}): this route takes {allowed}"
    return APIError(405, message, headers={"Allow": allowed})


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


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error `app` raises with an error body.

    Errors we raise on purpose are simply answered. Anything else reaches the catch-all, whose
    answer Starlette sends and then re-raises the error, so the server's log has the traceback.
    """
    app.add_exception_handler(APIError, _on_error)
    app.add_exception_handler(YaieError, _on_error)
    app.add_exception_handler(Exception, _on_error)
    app.add_exception_handler(RequestValidationError, _on_invalid_request)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

    async def no_route(scope: Scope, receive: Receive, send: Send) -> None:
        # The router's fallback when no route matches the path (whatever the method).
        if scope["type"] != "http":
            await WebSocketClose()(scope, receive, send)
            return
        error = unknown_route(app, scope["method"], scope["path"])
        await error.response(scope["path"])(scope, receive, send)

    app.router.default = no_route


async def _on_error(request: Request, exc: Exception) -> Response:
    return api_error(exc).response(request.url.path)


async def _on_invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = p.describe_validation_error(exc.errors())
    if error.param is None and not _is_json(request.headers.get("content-type")):
        error = InvalidRequestError("the body must be JSON, sent with Content-Type: application/json")
    return api_error(error).response(request.url.path)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    path = request.url.path
    if exc.status_code == 405:  # the router's: a known path
        return method_not_allowed(request).response(path)
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response(path)


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")
