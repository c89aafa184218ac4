"""The browser side of `yaie serve`: a chat page, a live view of the engine, and their data.

    GET /                the chat page (static/chat.html), over /v1/chat/completions
    GET /engine          the engine view (static/engine.html)
    GET /static/<file>   the pages' scripts and styles, from this package: no CDN, no build step
    GET /engine/state    one engine snapshot as JSON (schema: yaie/engine/snapshot.py)
    GET /engine/events   server-sent events, one snapshot `SNAPSHOT_INTERVAL_S` apart

The pages and their files are public (`PAGE_PATHS`), so that a browser can load them and then
ask for the API key; the data, like the API, needs the key. The pages send it as a header,
which is why they read event streams with fetch() rather than EventSource (it cannot send one).

A snapshot shows the whole engine's load but only the viewer's own text and request ids
(yaie/engine/snapshot.py), so each tenant (API key) has its feed. However many of its pages
watch, one `SnapshotFeed` takes one snapshot per interval on the engine thread and serializes
it once; every stream of that tenant sends those same bytes. While no stream is open it
takes none, and the engine's step log stops recording a few seconds later. When the engine
shuts down the streams end, so that open pages do not hold up the server's exit.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import Response, StreamingResponse

from yaie.engine.async_engine import AsyncEngine, EngineClosedError
from yaie.server.middleware import tenant_of

SNAPSHOT_INTERVAL_S = 0.25
STATIC_DIR = resources.files("yaie.server") / "static"
# Only these files are served: a name from the URL is looked up here, never joined to a path.
STATIC_FILES = {item.name: item for item in STATIC_DIR.iterdir() if item.is_file()}
MEDIA_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".svg": "image/svg+xml"}
PAGE_PATHS = frozenset({"/", "/engine"} | {f"/static/{name}" for name in STATIC_FILES})


class SnapshotFeed:
    """Engine snapshots, serialized, for any number of event streams at once."""

    def __init__(self, engine: AsyncEngine, viewer: str, interval_s: float = SNAPSHOT_INTERVAL_S) -> None:
        self.engine = engine
        self.viewer = viewer  # the tenant whose view this is
        self.interval_s = interval_s
        self._latest: bytes | None = None  # the newest event
        self._published = asyncio.Event()  # set, and replaced, at each new event
        self._ended = False  # no more events: the engine is shutting down
        self._num_watchers = 0
        self._task: asyncio.Task[None] | None = None

    async def stream(self) -> AsyncIterator[bytes]:
        """Each new snapshot as one SSE event, for as long as the caller iterates, or until
        the engine shuts down."""
        self._num_watchers += 1
        if self._task is None:
            self._latest, self._ended = None, False
            self._task = asyncio.create_task(self._run())
        try:
            sent: bytes | None = None
            while True:
                if self._latest is not None and self._latest is not sent:
                    sent = self._latest
                    yield sent
                elif self._ended:
                    return
                else:
                    await self._published.wait()
        finally:
            self._num_watchers -= 1

    async def _run(self) -> None:
        try:
            while self._num_watchers:
                try:
                    snapshot = await self.engine.snapshot(self.viewer)
                except EngineClosedError as exc:
                    self._publish({"error": str(exc)})
                    return
                self._publish(snapshot)
                await asyncio.sleep(self.interval_s)
        finally:
            self._ended, self._task = True, None
            self._publish(None)

    def _publish(self, snapshot: dict[str, Any] | None) -> None:
        if snapshot is not None:
            self._latest = b"data: " + _dumps(snapshot) + b"\n\n"
        self._published.set()
        self._published = asyncio.Event()


def web_router(engine: AsyncEngine) -> APIRouter:
    """The routes above, for `app.include_router`; list PAGE_PATHS among the public paths."""
    router = APIRouter()
    feeds: dict[str, SnapshotFeed] = {}  # by tenant: a few, one per API key's tenant at most

    @router.get("/", include_in_schema=False)
    async def chat_page() -> Response:
        return _static("chat.html")

    @router.get("/engine", include_in_schema=False)
    async def engine_page() -> Response:
        return _static("engine.html")

    @router.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        return _static(name)

    @router.get("/engine/state")
    async def engine_state(request: Request) -> Response:
        return Response(_dumps(await engine.snapshot(tenant_of(request))), media_type="application/json")

    @router.get("/engine/events")
    async def engine_events(request: Request) -> StreamingResponse:
        tenant = tenant_of(request)
        feed = feeds.setdefault(tenant, SnapshotFeed(engine, tenant))
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(feed.stream(), media_type="text/event-stream", headers=headers)

    return router


def _static(name: str) -> Response:
    item = STATIC_FILES.get(name)
    if item is None:
        raise HTTPException(404, f"no such file: {name}")
    suffix = name[name.rfind(".") :]
    return Response(item.read_bytes(), media_type=MEDIA_TYPES.get(suffix, "application/octet-stream"))


def _dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
