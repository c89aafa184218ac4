"""Every failure as OpenAI's error body, with a status a client can act on.

`{"error": {"message", "type", "param", "code"}}`: 400 for a bad request (naming the field), 401
without the API key, 404 for an unknown model, 413 for a body too large, 429 when too many
requests wait, 500 when the engine fails on a request, 503 while shutting down. Inside an event
stream, which has already answered 200, a failure is sent as one last error event instead
(streaming.py).

Anthropic's routes (/v1/messages...) answer the same errors in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}` (anthropic_protocol.error_body), since its
clients read that one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from yaie.engine.async_engine import EngineClosedError, EngineOverloadedError, RequestFailedError
from yaie.errors import InvalidRequestError, YaieError
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
        return p.ErrorResponse(error=self.info).model_dump()


ANTHROPIC_PATHS = "/v1/messages"  # Anthropic's Messages API: its clients read its error shape


class ClientDisconnected(APIError):
    """The client went away before its response was complete (its requests are aborted)."""

    def __init__(self) -> None:
        super().__init__(499, "the client disconnected")  # nobody is left to read this


def model_not_found(name: str) -> APIError:
    return APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")


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
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response(request.url.path)


def _is_json(content_type: str | None) -> bool:
    media_type = (content_type or "application/json").split(";")[0].strip().lower()
    return media_type == "application/json" or media_type.endswith("+json")
