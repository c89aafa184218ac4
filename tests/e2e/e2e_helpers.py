"""Helpers for the end-to-end tests: real `yaie serve` processes on loopback ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "smol"
NUM_KV_BLOCKS = 512  # 8192 tokens, the model's whole context, and quick to allocate
STARTUP_TIMEOUT_S = 180  # generous: the CI machine may be busy with other jobs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This environment without YAIE_* settings, which would change the servers we start."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("YAIE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def yaie_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "yaie.cli", *args]


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    api_key: str | None = None

    def client(self, **kwargs: object) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.api_key or "none", **kwargs)  # type: ignore[arg-type]

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=60)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, as a service manager would; returns the exit status."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    log_dir: Path, *args: str, api_key: str | None = None, quantization: str | None = "none"
) -> Server:
    """`yaie serve` with the bundled model and `args`. `quantization` "none" by default: the tests
    compare one request's greedy output with another's (streamed or not, cached or not, CLI or
    API, in-process), and only the dense path is batch-invariant; the quantized one rounds a
    prompt differently when it is prefilled beside others (docs/quantization.md). None: the
    server's own default."""
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    command = yaie_command(
        "serve",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--num-kv-blocks",
        str(NUM_KV_BLOCKS),
        *args,
    )
    if quantization is not None:
        command += ["--quantization", quantization]
    if api_key:
        command += ["--api-key", api_key]
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=clean_env())
    server = Server(process, f"http://127.0.0.1:{port}", log_path, api_key)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.25)
    server.stop()
    pytest.fail(f"the server did not come up in {STARTUP_TIMEOUT_S} s:\n{server.log()}")
