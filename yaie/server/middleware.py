"""ASGI middleware that answers before the app reads a request: the API key, the body's size."""

from __future__ import annotations

import hmac
from collections.abc import Collection, Mapping
from urllib.parse import parse_qsl

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from yaie.engine.sequence import ANONYMOUS_TENANT
from yaie.server.errors import APIError

# Query parameters some clients put a key in. A URL is written to access logs, proxies' logs and
# browser histories, so a key there is refused (and never logged: yaie/cli/serve.py).
KEY_QUERY_PARAMETERS = frozenset({"api_key", "api-key", "key", "apikey", "token", "access_token"})


class RequireAPIKey:
    """Without `Authorization: Bearer <key>` (or `x-api-key: <key>`, Anthropic's header) carrying
    one of `tenants`' keys, only `public_paths` answer. A request with a key is its tenant's
    (`tenants[key]`): `tenant_of(request)` says whose.

    Checked before anything reads the body, so a client without a key learns nothing else.
    The scheme's name is case-insensitive (RFC 9110); the key is compared with every key in
    constant time, so the time taken tells nothing about which key came close.
    """

    def __init__(self, app: ASGIApp, tenants: Mapping[str, str], public_paths: Collection[str]) -> None:
        self.app = app
        self.tenants = [(key.encode(), tenant) for key, tenant in tenants.items()]
        self.public_paths = public_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            headers = dict(scope["headers"])
            scheme, _, bearer = headers.get(b"authorization", b"").partition(b" ")
            presented = [headers.get(b"x-api-key", b"")]
            if scheme.lower() == b"bearer":
                presented.append(bearer.strip())
            tenant = None
            for key, name in self.tenants:  # every comparison made, whatever matches
                if any([hmac.compare_digest(candidate, key) for candidate in presented]):
                    tenant = name
            if tenant is None:
                await self._refuse(scope, receive, send)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send) -> None:
        message = "missing or incorrect API key"
        query = parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        if any(name.lower() in KEY_QUERY_PARAMETERS for name, _ in query):
            message += (
                ": a key in the URL is not accepted (URLs end up in logs); send it in the "
                "Authorization: Bearer header (or x-api-key)"
            )
        error = APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        await error.response(scope["path"])(scope, receive, send)


def tenant_of(request: Request) -> str:
    """Whose request this is: its API key's tenant, or the one anonymous tenant of a server
    without keys."""
    tenant: str = getattr(request.state, "tenant", ANONYMOUS_TENANT)
    return tenant


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
