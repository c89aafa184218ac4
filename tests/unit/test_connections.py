"""The request-head deadline (yaie/server/connections.py) on a real uvicorn server and sockets."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn

from yaie.server.connections import http_protocol

HEAD_TIMEOUT = 1
REQUEST = b"GET / HTTP/1.1\r\nHost: test\r\n\r\n"


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    if scope["path"] == "/slow":  # a response that takes longer than the head deadline
        await asyncio.sleep(HEAD_TIMEOUT * 1.5)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        free = sock.getsockname()[1]
    config = uvicorn.Config(
        hello,
        host="127.0.0.1",
        port=free,
        lifespan="off",
        log_level="warning",
        timeout_keep_alive=60,  # longer than the head deadline: the deadline is what acts
        http=http_protocol(HEAD_TIMEOUT),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield free
    server.should_exit = True
    thread.join()


def closed_by_server(sock: socket.socket, wait: float) -> bool:
    """Whether the server has closed the connection, waiting up to `wait` seconds to see."""
    readable, _, _ = select.select([sock], [], [], wait)
    if not readable:
        return False
    try:
        return sock.recv(4096) == b""  # nothing was asked in full, so nothing is answered
    except ConnectionResetError:
        return True


def test_a_trickled_head_is_cut_off(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: ")
        # One byte at a time, each well within uvicorn's keep-alive timeout, which every byte
        # would reset: only the head deadline can end this.
        sent = 0
        while not closed_by_server(sock, 0.1):
            sock.sendall(b"a")
            sent += 1
            assert sent < 200, "the connection outlived the head deadline by far"
        assert sent >= 5  # it was the deadline, not the first byte, that ended it


def test_requests_on_a_kept_alive_connection_each_get_the_deadline(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        for _ in range(3):
            sock.sendall(REQUEST)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(HEAD_TIMEOUT / 4)  # idle between requests, within the deadline
        # Then nothing: the connection is closed once the deadline passes.
        assert closed_by_server(sock, 20)


def test_a_pipelined_request_is_not_cut_off_while_it_is_answered(port: int) -> None:
    """Its head arrived with the first request's, so the deadline has nothing to wait for."""
    slow = b"GET /slow HTTP/1.1\r\nHost: test\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(slow + slow)
        received = b""
        while received.count(b"HTTP/1.1 200") < 2:
            chunk = sock.recv(4096)
            assert chunk, f"the connection was closed after {received.count(b'HTTP/1.1 200')} response(s)"
            received += chunk
