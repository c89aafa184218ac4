"""A deadline for each request's head, which uvicorn does not have (slowloris).

uvicorn closes a keep-alive connection that stays idle after a response, but any byte that
arrives resets that timer, and nothing bounds the time a new connection may take to send its
request line and headers. A client that trickles one header byte every few seconds holds a
connection (and a file descriptor) for as long as it likes; a few thousand such clients exhaust
the server. Here a connection gets `head_timeout` seconds, from when it opens or from the end of
its previous response, to deliver a complete request head, whatever it sends meanwhile; then it
is closed. The body is bounded in size by the app (LimitRequestBytes), not in time.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _HeadDeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, plus the deadline. Made with `http_protocol(head_timeout)`.

    httptools, not h11: a streamed token is one chunk written through the protocol, and h11's
    pure-Python writer was half of the event loop's time per token at one client."""

    head_timeout: float

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm()

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        # A pipelined request waiting its turn has delivered its head already, and starts now.
        pipelined = bool(self.pipeline)
        super().on_response_complete()
        if not self.transport.is_closing() and not pipelined:
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.head_timeout, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()


def http_protocol(head_timeout: float) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (`uvicorn.Config(http=...)`)."""
    return type("HeadDeadlineProtocol", (_HeadDeadlineProtocol,), {"head_timeout": head_timeout})
