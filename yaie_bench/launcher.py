"""Start a `yaie serve` process for a load test and stop it afterwards."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


@contextmanager
def yaie_server(
    serve_args: list[str],
    log: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """`yaie serve` with `serve_args` on a free loopback port, answering /health when yielded as
    (its process, its base URL); stopped with SIGTERM (killed after 30 s) on exit. Its output
    goes to `log` if given, else to ours; `env` replaces our environment if given."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "yaie.cli", "serve", *serve_args, "--host", "127.0.0.1"]
    command += ["--port", str(port)]
    print(f"starting: {' '.join(command[2:])}", file=sys.stderr)
    if log is None:
        process = subprocess.Popen(command, env=env)
    else:
        with log.open("wb") as sink:
            process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                tail = log.read_text(errors="replace")[-4000:] if log else ""
                raise SystemExit(f"error: the server exited with code {process.returncode}\n{tail}")
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise SystemExit(f"error: the server did not answer /health within {timeout_s:.0f} s")
            time.sleep(0.25)
        yield process, base_url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
