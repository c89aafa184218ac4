"""The `yaie` command: `generate` once, `serve` the OpenAI API, `chat` in a terminal, `bench` a server."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import httpx
import uvicorn
from rich.console import Console
from rich.markup import escape

import yaie
from yaie.config import EngineConfig
from yaie.engine.async_engine import AsyncEngine
from yaie.engine.engine import Engine
from yaie.errors import InvalidRequestError, YaieError
from yaie.sampling_params import SamplingParams
from yaie.server.app import build_app

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False)

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """'2GiB' -> 2147483648. KiB/MiB/GiB/TiB (and bare K/M/G/T) are powers of 1024, KB/MB/GB/TB
    powers of 1000."""
    match = _SIZE.fullmatch(text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (try 512MiB or 2GiB)")
    number, unit, binary, bytes_suffix = match.groups()
    base = 1000 if unit and bytes_suffix and not binary else 1024
    return int(float(number) * base ** ("kmgt".find(unit.lower()) + 1 if unit else 0))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _env_flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


class _EnvDefaults:
    """Adds options whose defaults can come from YAIE_<OPTION> environment variables."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add(self, name: str, **kwargs: Any) -> None:
        env = "YAIE_" + name.lstrip("-").replace("-", "_").upper()
        if env in os.environ:
            value = os.environ[env]
            # argparse runs `type` over string defaults, so other values parse as on the command line.
            kwargs["default"] = _env_flag(value) if kwargs.get("action") == "store_true" else value
        kwargs["help"] = f"{kwargs.get('help', '')} [env: {env}]".strip()
        self.parser.add_argument(name, **kwargs)


def _add_engine_args(add: Any) -> None:
    add(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "float16", "bfloat16"),
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )
    add("--max-model-len", type=_positive_int, help="context length (default: the model's)")
    add("--num-kv-blocks", type=_positive_int, help="KV cache blocks (overrides --kv-cache-memory)")
    add(
        "--kv-cache-memory",
        type=parse_bytes,
        help="KV cache size, e.g. 2GiB (default: a share of free memory)",
    )


def _engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        **overrides,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yaie", description="Yet Another Inference Engine")
    parser.add_argument("--version", action="version", version=f"yaie {yaie.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="complete one prompt, streaming to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--model", help="a .gguf file or HF directory (default: the bundled SmolLM2-135M)")
    generate.add_argument("--max-tokens", type=_positive_int, default=256)
    generate.add_argument("--temperature", type=float, default=0.7)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    _add_engine_args(generate.add_argument)
    generate.set_defaults(run=run_generate)

    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Every option can also be set from YAIE_* env.",
    )
    env = _EnvDefaults(serve)
    env.add("model", nargs="?", help="a .gguf file or HF directory (default: the bundled SmolLM2-135M)")
    _add_engine_args(env.add)
    env.add("--max-num-seqs", type=_positive_int, default=64, help="most sequences decoding together")
    env.add("--max-num-batched-tokens", type=_positive_int, default=2048, help="token budget of one step")
    env.add("--block-size", type=_positive_int, default=16, help="tokens per KV cache block")
    env.add(
        "--no-prefix-caching", action="store_true", help="do not reuse the KV cache of shared prompt prefixes"
    )
    env.add("--served-model-name", help="the model name clients use (default: the model's path or file stem)")
    env.add("--api-key", help="require `Authorization: Bearer KEY` on the API")
    env.add("--host", default="127.0.0.1")
    env.add("--port", type=int, default=8000)
    env.add("--log-level", default="info", choices=LOG_LEVELS)
    env.add(
        "--max-waiting",
        type=_positive_int,
        default=512,
        help="answer 429 when this many sequences already wait",
    )
    serve.set_defaults(run=run_serve)

    chat = commands.add_parser("chat", help="chat in the terminal, with a local model or a server")
    chat.add_argument("model", nargs="?", help="local: model path (default: bundled); with --url: model name")
    chat.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000/v1")
    chat.add_argument(
        "--api-key", default=os.environ.get("YAIE_API_KEY"), help="for --url [env: YAIE_API_KEY]"
    )
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-tokens", type=_positive_int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    _add_engine_args(chat.add_argument)
    chat.set_defaults(run=run_chat)
    bench = commands.add_parser(
        "bench",
        help="start a yaie server with the given serve options and load-test it",
        description="Options not listed here (a model path, --max-num-seqs 32, --no-prefix-caching, ...) "
        "go to `yaie serve`. The load generator is the one in benchmarks/serve_bench.py.",
    )
    bench.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrency levels")
    bench.add_argument("--num-requests", default="32", help="requests per level")
    bench.add_argument("--prompt-set", choices=("short", "long", "shared-prefix"), default="short")
    bench.add_argument("--max-tokens", default="128")
    bench.add_argument("--out", help="write the results as JSON here")
    bench.set_defaults(run=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.serve_args = extra  # `yaie bench` hands the options it does not know to `yaie serve`
    try:
        return args.run(args)
    except (YaieError, ValueError) as exc:  # a model we cannot load, a configuration that cannot work
        err_console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130


# -- generate ---------------------------------------------------------------------------------


def run_generate(args: argparse.Namespace) -> int:
    engine = Engine(_engine_config(args))
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    request_id = engine.add_request(None, prompt, params)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                sys.stdout.write(output.outputs[0].delta_text)
                sys.stdout.flush()
    finally:
        engine.abort(request_id)  # after Ctrl-C; a finished request is already gone
    sys.stdout.write("\n")
    return 0


# -- serve ------------------------------------------------------------------------------------


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    config = _engine_config(
        args,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=not args.no_prefix_caching,
    )
    async_engine = AsyncEngine(lambda: Engine(config))
    name = args.served_model_name or args.model or Path(async_engine.model_path).stem
    app = build_app(async_engine, name, api_key=args.api_key, max_waiting=args.max_waiting)
    server_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5
    )
    Server(server_config, async_engine, name).run()
    async_engine.shutdown()
    return 0


class Server(uvicorn.Server):
    """uvicorn's server, with our banner and our way of stopping."""

    def __init__(self, config: uvicorn.Config, async_engine: AsyncEngine, model_name: str) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.model_name = model_name

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # now listening; with --port 0 this is where the port becomes known
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            console.print(
                f"[bold green]yaie[/] serving [bold]{escape(self.model_name)}[/] "
                f"({escape(str(self.async_engine.model_path))}) at http://{host}:{port}/v1"
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # uvicorn would re-raise the signal once shut down, ending the process with a traceback
        # (SIGINT) or status -15 (SIGTERM); a requested stop is a clean exit for us.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for connections
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        # Before uvicorn waits for open connections to finish: end every stream now (each gets
        # an error event) rather than after its last token.
        self.async_engine.shutdown()
        await super().shutdown(sockets)


# -- chat -------------------------------------------------------------------------------------


class LocalChat:
    """Answers from an Engine in this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.engine = Engine(_engine_config(args))
        self.name = Path(self.engine.model_path).stem

    def stream(self, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> Iterator[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        request_id = self.engine.add_request(None, self.engine.encode_chat(messages), params)
        try:
            while self.engine.has_unfinished_requests():
                for output in self.engine.step():
                    yield output.outputs[0].delta_text
        finally:
            self.engine.abort(request_id)  # when stopped early; a finished request is already gone


class RemoteChat:
    """Answers from a server, through the `openai` client (needed only here)."""

    def __init__(self, args: argparse.Namespace) -> None:
        try:
            import openai
        except ImportError:
            raise YaieError("`yaie chat --url` needs the openai package: pip install openai") from None
        self.openai = openai
        self.client = openai.OpenAI(base_url=args.url, api_key=args.api_key or "none")
        try:
            self.name = args.model or self.client.models.list().data[0].id
        except openai.OpenAIError as exc:
            raise YaieError(f"cannot reach {args.url}: {exc}") from exc

    def stream(self, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> Iterator[str]:
        stream = self.client.chat.completions.create(
            model=self.name,
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,  # type: ignore[arg-type]
        )
        with stream:  # when stopped early, closing the connection aborts the request
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content


def run_chat(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and input history for input())

    backend: LocalChat | RemoteChat = RemoteChat(args) if args.url else LocalChat(args)
    errors: tuple[type[Exception], ...] = (InvalidRequestError,)
    if isinstance(backend, RemoteChat):
        errors += (backend.openai.OpenAIError,)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    console.print(
        f"[bold]yaie chat[/] with [bold]{escape(backend.name)}[/]. "
        "/reset starts over, /exit quits, Ctrl-C stops an answer.",
    )
    while True:
        try:
            line = console.input("[bold cyan]you>[/] ").strip()
        except (KeyboardInterrupt, EOFError):
            console.print()
            return 0
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = list(system)
            console.print("[dim](conversation cleared)[/]")
            continue
        if not line:
            continue
        if line.startswith("/"):
            console.print("[yellow]commands: /reset, /exit[/]")
            continue
        messages.append({"role": "user", "content": line})
        answer = ""
        try:
            console.print("[bold magenta]assistant>[/] ", end="")
            for delta in backend.stream(messages, args.max_tokens, args.temperature):
                answer += delta
                sys.stdout.write(delta)
                sys.stdout.flush()
        except KeyboardInterrupt:
            console.print(" [dim](stopped)[/]", end="")
        except errors as exc:
            messages.pop()  # the question failed: leave it out of the history
            console.print(f"\n[red]error:[/] {escape(str(exc))}")
            continue
        console.print()
        messages.append({"role": "assistant", "content": answer})


# -- bench ------------------------------------------------------------------------------------


def run_bench(args: argparse.Namespace) -> int:
    from yaie import bench

    with socket.socket() as probe:  # a free loopback port for the server
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "yaie.cli", "serve", *args.serve_args, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--log-level", "warning"]
    err_console.print(f"starting: {' '.join(command[2:])}")
    server = subprocess.Popen(command)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                err_console.print(f"[red]error:[/] the server exited with code {server.returncode}")
                return 1
            try:
                if httpx.get(f"{base_url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                err_console.print("[red]error:[/] the server did not become healthy within 300 s")
                return 1
            time.sleep(0.5)
        bench_argv = ["--base-url", base_url, "--concurrency", args.concurrency, "--label", "yaie"]
        bench_argv += ["--num-requests", args.num_requests, "--prompt-set", args.prompt_set]
        bench_argv += ["--max-tokens", args.max_tokens, "--ignore-eos"]
        if args.out:
            bench_argv += ["--out", args.out]
        return bench.main(bench_argv)
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
