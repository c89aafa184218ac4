"""ASGI middleware that answers before the app reads a request: the API key, the body's size."""

from __future__ import annotations

import hmac
from collections.abc import Collection

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from yaie.server.errors import APIError


class RequireAPIKey:
    """Without `Authorization: Bearer <key>` (or `x-api-key: <key>`, Anthropic's header), only
    `public_paths` answer.

    Checked before anything reads the body, so a client without the key learns nothing else.
    The scheme's name is case-insensitive (RFC 9110); the key is compared in constant time.
    """

    def __init__(self, app: ASGIApp, api_key: str, public_paths: Collection[str]) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            headers = dict(scope["headers"])
            scheme, _, key = headers.get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.expected)
            if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected):
                error = APIError(
                    401,
                    "missing or incorrect API key",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class LimitRequestBytes:
    """A 413 for a body over `max_bytes`, before any of it is parsed.

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
                await self._too_large().response(scope["path"])(scope, receive, send)
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
