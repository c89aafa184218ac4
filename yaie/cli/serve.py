"""`yaie serve`: the OpenAI-compatible API over HTTP, on an engine thread of its own."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import socket
from pathlib import Path
from types import FrameType

import uvicorn
from rich.markup import escape

from yaie.cli.engine_args import add_engine_args, engine_config
from yaie.cli.options import EnvDefaults, Repeatable, parse_bytes, positive_int, positive_seconds
from yaie.cli.terminal import console, loading_bar
from yaie.engine.async_engine import AsyncEngine
from yaie.engine.engine import Engine
from yaie.server.app import ServerLimits, build_app
from yaie.server.connections import http_protocol
from yaie.server.reasoning import REASONING_PARSERS

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = commands.add_parser(
        "serve",
        help="serve the OpenAI-compatible API",
        description="Every option can also be set from YAIE_* env.",
    )
    env = EnvDefaults(serve)
    env.add("model", nargs="?", help="a .gguf file or HF directory (default: the bundled SmolLM2-135M)")
    add_engine_args(serve)
    env.add("--served-model-name", help="the model name clients use (default: the model's path or file stem)")
    env.add(
        "--api-key",
        action=Repeatable,
        help="require `Authorization: Bearer KEY` on the API; give it again for more keys, each its own "
        "tenant (key-1, key-2, ...), sharing the engine fairly with the others",
    )
    env.add(
        "--api-keys-file",
        type=Path,
        help='a JSON object of API keys and their tenants\' names, {"KEY": "TENANT", ...} (several keys '
        "may name one tenant): the tenants share the engine fairly, each sees only its own",
    )
    env.add("--host", default="127.0.0.1")
    env.add("--port", type=int, default=8000)
    env.add("--log-level", default="info", choices=LOG_LEVELS)
    env.add(
        "--max-waiting",
        type=positive_int,
        default=512,
        help="answer 429 when this many sequences already wait",
    )
    env.add(
        "--max-waiting-per-tenant",
        type=positive_int,
        help="answer an API key's tenant 429 when this many of its sequences already wait (default: an "
        "equal share of --max-waiting per tenant, so one tenant's flood never locks the others out)",
    )
    limits = ServerLimits()
    env.add(
        "--max-request-bytes",
        type=parse_bytes,
        default=str(limits.max_request_bytes),
        help="answer 413 for a bigger request body, e.g. 8MiB",
    )
    env.add(
        "--max-seqs-per-request",
        type=positive_int,
        default=limits.max_seqs_per_request,
        help="most sequences (prompts x n) one request may run",
    )
    env.add(
        "--default-max-tokens",
        type=positive_int,
        default=limits.default_max_tokens,
        help="max_tokens of a request that leaves it out, cut to the context the prompt leaves "
        "(vLLM's default is the whole rest of the context)",
    )
    env.add(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        help="split chat answers of a model that thinks in <think> tags into reasoning_content and "
        "content (vLLM's: deepseek_r1 when the output starts in thought, qwen3 when the template opens it)",
    )
    env.add(
        "--request-timeout",
        type=positive_seconds,
        help="seconds after which a request that sets no `timeout` of its own ends, finished or not, "
        'with finish_reason "timeout" (default: none)',
    )
    env.add(
        "--timeout-keep-alive",
        type=positive_int,
        default=5,
        help="seconds an idle keep-alive connection is kept open",
    )
    env.add(
        "--timeout-request-head",
        type=positive_int,
        default=30,
        help="seconds a connection has to send a complete request line and headers (slowloris)",
    )
    serve.set_defaults(run=run)


def api_keys(keys: list[str] | None, keys_file: Path | None) -> dict[str, str] | None:
    """The API keys that open the server, each to its tenant's name: `--api-key`s (named key-1,
    key-2, ... in the order given) and `--api-keys-file`'s; None when neither is given (an open
    server). Raises ValueError, saying what is wrong, rather than serve with a key that would
    not do what its operator meant (an empty one would open the server to anyone)."""
    if keys is None and keys_file is None:
        return None
    tenants = {}
    for index, key in enumerate(keys or [], start=1):
        tenants[_checked_key(key, "--api-key")] = f"key-{index}"
    if keys_file is not None:
        where = f"--api-keys-file {keys_file}"
        try:
            listed = json.loads(keys_file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{where}: cannot read a JSON object of keys and tenants: {exc}") from None
        if not isinstance(listed, dict) or not listed:
            raise ValueError(f'{where}: expected a JSON object of API keys and tenants, {{"KEY": "TENANT"}}')
        generated = set(tenants.values())
        for key, tenant in listed.items():
            _checked_key(key, where)
            if not isinstance(tenant, str) or not tenant.strip():
                raise ValueError(f"{where}: a key's tenant must be a non-empty string, got {tenant!r}")
            if key in tenants:
                raise ValueError(f"{where}: a key is given twice (also as --api-key)")
            if tenant in generated:
                raise ValueError(f"{where}: the tenant name {tenant!r} is the one an --api-key key is given")
            tenants[key] = tenant
    return tenants


def _checked_key(key: str, where: str) -> str:
    if not key.strip():
        raise ValueError(
            f"{where}: an empty API key would let anyone in; give a key, or leave the option out to serve "
            "without one"
        )
    if key != key.strip() or any(character.isspace() for character in key):
        raise ValueError(f"{where}: an API key cannot hold spaces (clients could never send it)")
    return key


class RedactQueryStrings(logging.Filter):
    """Access log lines without the values of query strings. The API reads nothing from them, and
    a client that puts its API key there (`?api_key=`) must not have it written to the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        # uvicorn's access record: (client address, method, path with query, HTTP version, status)
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str) and "?" in args[2]:
            path, _, query = args[2].partition("?")
            names = [part.partition("=")[0] for part in query.split("&")]
            redacted = "&".join(f"{name}=[redacted]" for name in names)
            record.args = (*args[:2], f"{path}?{redacted}", *args[3:])
        return True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    keys = api_keys(args.api_key, args.api_keys_file)  # before the model loads: a bad key fails fast
    config = engine_config(args)
    with loading_bar() as progress:
        async_engine = AsyncEngine(lambda: Engine(config, load_progress=progress))
    name = args.served_model_name or args.model or Path(async_engine.model_path).stem
    limits = ServerLimits(
        max_waiting=args.max_waiting,
        max_waiting_per_tenant=args.max_waiting_per_tenant,
        max_request_bytes=args.max_request_bytes,
        max_seqs_per_request=args.max_seqs_per_request,
        default_max_tokens=args.default_max_tokens,
        request_timeout=args.request_timeout,
    )
    try:  # the model's generation_config.json is read here: a bad one stops the start
        app = build_app(
            async_engine, name, api_keys=keys, limits=limits,
            generation_config_source=config.generation_config, reasoning_parser=args.reasoning_parser,
        )  # fmt: skip
    except BaseException:
        async_engine.shutdown()
        raise
    server_config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        # Closes a connection idle this long after a response; yaie/server/connections.py
        # adds the deadline for a request's head that uvicorn lacks.
        timeout_keep_alive=args.timeout_keep_alive,
        http=http_protocol(args.timeout_request_head),
    )
    logging.getLogger("uvicorn.access").addFilter(RedactQueryStrings())  # uvicorn's logging is set up now
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
