"""The `yaie` command: `generate` once, `serve` the OpenAI API, `chat` in a terminal, `bench` a server,
`plan` a model's memory, `simulate` batching policies."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import yaie
from yaie.config import KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig
from yaie.engine.async_engine import AsyncEngine
from yaie.engine.engine import Engine
from yaie.errors import InvalidRequestError, YaieError
from yaie.model.loader import LoadProgress
from yaie.sampling_params import SamplingParams
from yaie.server.app import ServerLimits, build_app
from yaie.server.connections import http_protocol

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


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
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
    add(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: a GGUF file's or an AWQ/GPTQ checkpoint's weights run as stored, a dense checkpoint in "
        "--dtype; none: dequantize to --dtype (exact transformers parity); int8, int4: quantize a dense "
        "checkpoint at load",
    )
    add(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores; auto: --dtype, or float16 under quantized weights (as llama.cpp). "
        "16 bits hold twice the tokens in the same memory",
    )
    add("--max-model-len", type=_positive_int, help="context length (default: the model's)")
    add("--num-kv-blocks", type=_positive_int, help="KV cache blocks (overrides --kv-cache-memory)")
    add(
        "--kv-cache-memory",
        type=parse_bytes,
        help="KV cache size, e.g. 2GiB (default: a share of free memory)",
    )
    add(
        "--threads",
        type=_positive_int,
        help="CPU threads the model runs on (default: one per core). Where another program keeps a "
        "core busy, one thread fewer than cores decodes faster: every step waits for its slowest thread",
    )
    add(
        "--speculative-config",
        type=_json_object,
        help='speculative decoding, as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'',
    )


def _engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory=args.kv_cache_memory,
        speculative_config=args.speculative_config,
        num_threads=args.threads,
        **overrides,
    )


def _log_to_terminal() -> None:
    """Show what the library logs (the model and kernels loading, warnings) on stderr, as rich
    lines. Only where nothing configured logging already: `serve` sets it up its own way."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_time=False, show_path=False)],
    )
    logging.getLogger("yaie").setLevel(logging.INFO)


@contextlib.contextmanager
def _loading_bar() -> Iterator[LoadProgress]:
    """A progress bar on stderr while the engine loads the model (none where stderr is not a
    terminal); yields the callback for Engine's `load_progress`."""
    with Progress(
        TextColumn("[bold]loading[/] the model"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} tensors"),
        TimeElapsedColumn(),
        console=err_console,
        transient=True,
        disable=not err_console.is_terminal,
    ) as progress:
        task = progress.add_task("model", total=None)

        def advance(done: int, total: int) -> None:
            progress.update(task, completed=done, total=total)

        yield advance


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
    limits = ServerLimits()
    env.add(
        "--max-request-bytes",
        type=parse_bytes,
        default=str(limits.max_request_bytes),
        help="answer 413 for a bigger request body, e.g. 8MiB",
    )
    env.add(
        "--max-seqs-per-request",
        type=_positive_int,
        default=limits.max_seqs_per_request,
        help="most sequences (prompts x n) one request may run",
    )
    env.add(
        "--default-max-tokens",
        type=_positive_int,
        default=limits.default_max_tokens,
        help="max_tokens of a request that leaves it out, cut to the context the prompt leaves "
        "(vLLM's default is the whole rest of the context)",
    )
    env.add(
        "--timeout-keep-alive",
        type=_positive_int,
        default=5,
        help="seconds an idle keep-alive connection is kept open",
    )
    env.add(
        "--timeout-request-head",
        type=_positive_int,
        default=30,
        help="seconds a connection has to send a complete request line and headers (slowloris)",
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
    bench.add_argument(
        "--fit-cost-model",
        metavar="PATH",
        help="instead of load-testing: time the engine's steps over a range of batch shapes and write "
        "the fitted step-time model for `yaie simulate --cost-model` here",
    )
    bench.set_defaults(run=run_bench)
    _add_plan_parser(commands)
    _add_simulate_parser(commands)
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
    _log_to_terminal()
    with _loading_bar() as progress:
        engine = Engine(_engine_config(args), load_progress=progress)
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
    with _loading_bar() as progress:
        async_engine = AsyncEngine(lambda: Engine(config, load_progress=progress))
    name = args.served_model_name or args.model or Path(async_engine.model_path).stem
    limits = ServerLimits(
        max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes,
        max_seqs_per_request=args.max_seqs_per_request,
        default_max_tokens=args.default_max_tokens,
    )
    app = build_app(async_engine, name, api_key=args.api_key, limits=limits)
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
        _log_to_terminal()
        with _loading_bar() as progress:
            self.engine = Engine(_engine_config(args), load_progress=progress)
        self.name = self.engine.model_info.path.stem

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
    from yaie_bench import cli as bench_cli
    from yaie_bench.cost_fit import fit_cost_model, fit_front_end
    from yaie_bench.launcher import yaie_server

    if args.fit_cost_model:
        serve = build_parser().parse_args(["serve", *args.serve_args])
        config = _engine_config(
            serve,
            max_num_seqs=serve.max_num_seqs,
            max_num_batched_tokens=serve.max_num_batched_tokens,
            block_size=serve.block_size,
            enable_prefix_caching=not serve.no_prefix_caching,
        )
        cost, error = fit_cost_model(config)
        console.print(f"engine: {cost.describe()} (median step error {error:.1%})")
        quiet = [*args.serve_args, "--log-level", "warning"]
        with yaie_server(quiet) as (_, base_url):  # the same engine, behind the real front end
            cost = fit_front_end(base_url, cost, console)
        cost.save(Path(args.fit_cost_model))
        console.print(f"with the front end: {cost.describe()}; wrote {args.fit_cost_model}")
        return 0

    with yaie_server([*args.serve_args, "--log-level", "warning"]) as (_, base_url):
        bench_argv = ["--base-url", base_url, "--concurrency", args.concurrency, "--label", "yaie"]
        bench_argv += ["--num-requests", args.num_requests, "--prompt-set", args.prompt_set]
        bench_argv += ["--max-tokens", args.max_tokens, "--ignore-eos"]
        if args.out:
            bench_argv += ["--out", args.out]
        return bench_cli.main(bench_argv)


# -- plan -------------------------------------------------------------------------------------


def _context_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(parse_bytes(part) for part in text.split(",") if part.strip())
    except argparse.ArgumentTypeError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected context lengths like 2048,8k,32k; got {text!r}")
    return values


def _add_plan_parser(commands: Any) -> None:
    from yaie.plan.memory import KV_BYTES, WEIGHT_BYTES
    from yaie.plan.planner import DEFAULT_CONTEXTS

    plan = commands.add_parser(
        "plan",
        help="weights, KV cache and concurrent sequences of a model on a GPU",
        description="MODEL is a preset (Llama-3-8B, Mixtral-8x7B, ...), a config.json, a HF folder or a "
        ".gguf file (default: the bundled SmolLM2-135M). Sizes: 80GiB, 24GB, 512MiB.",
    )
    plan.add_argument("model", nargs="?", help="preset name, config.json, HF folder or .gguf file")
    budget = plan.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", type=parse_bytes, help="memory of each GPU")
    budget.add_argument(
        "--kv-cache-memory", type=parse_bytes, help="KV cache size per GPU, as `yaie serve` takes it"
    )
    plan.add_argument(
        "--dtype", choices=list(WEIGHT_BYTES), help="weights (default: bfloat16, or a GGUF file's own)"
    )
    plan.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *KV_BYTES])
    plan.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    plan.add_argument("--block-size", type=_positive_int, default=16)
    plan.add_argument(
        "--context",
        type=_context_list,
        default=DEFAULT_CONTEXTS,
        help="comma-separated context lengths to count sequences at (default 2k,4k,8k,32k,128k)",
    )
    plan.add_argument("--max-num-seqs", type=_positive_int, default=256, help="for the activation estimate")
    plan.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048, help="likewise")
    plan.add_argument(
        "--framework-overhead", type=parse_bytes, default="1GiB", help="CUDA context, allocator slack"
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(run=run_plan)


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "-"
    return (
        f"{num_bytes / (1 << 30):,.2f} GiB" if num_bytes >= 1 << 30 else f"{num_bytes / (1 << 20):,.1f} MiB"
    )


def run_plan(args: argparse.Namespace) -> int:
    import json

    from yaie.plan import Overhead, load_model_source, make_plan

    result = make_plan(
        load_model_source(args.model),
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        memory=args.memory,
        kv_cache_memory=args.kv_cache_memory,
        tensor_parallel_size=args.tensor_parallel_size,
        block_size=args.block_size,
        contexts=args.context,
        overhead=Overhead(args.framework_overhead, args.max_num_batched_tokens, args.max_num_seqs),
    )
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    arch = result.architecture
    tp = result.tensor_parallel_size
    table = Table(
        title=f"{escape(result.model)} ({arch.name}), {result.dtype} weights, tp={tp}", show_header=False
    )
    table.add_column(style="bold")
    table.add_column(justify="right")
    params = f"{result.num_parameters / 1e9:,.2f} B"
    if result.num_active_parameters != result.num_parameters:
        params += f" ({result.num_active_parameters / 1e9:,.2f} B active per token)"
    kv_token = f"{result.kv_bytes_per_token / 1024:,.1f} KiB ({result.kv_cache_dtype})"
    if arch.sliding_window:
        kv_token += (
            f", sliding window {arch.sliding_window} on {sum(w is not None for w in arch.layer_windows)}"
        )
        kv_token += f"/{arch.num_layers} layers"
    rows = [
        ("parameters", params),
        ("weights", f"{_size(result.weight_bytes)} ({_size(result.weight_bytes_per_gpu)} per GPU)"),
        ("KV per token", kv_token),
        ("memory per GPU", _size(result.memory_per_gpu)),
        ("runtime overhead per GPU", _size(result.overhead_bytes_per_gpu)),
        ("KV cache per GPU", _size(result.kv_cache_bytes_per_gpu)),
        (
            "KV budget",
            f"{result.kv_budget_tokens:,} tokens = {result.kv_budget_blocks:,} blocks of {result.block_size}",
        ),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for context, count in result.max_sequences.items():
        shown = "beyond the model's context" if count is None else f"{count:,}"
        table.add_row(f"sequences at {context:,} tokens", shown)
    console.print(table)
    return 0


# -- simulate ---------------------------------------------------------------------------------


def _length_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        values = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r}") from None
    if not 1 <= values[0] <= values[1]:
        raise argparse.ArgumentTypeError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return values


def _add_simulate_parser(commands: Any) -> None:
    sim = commands.add_parser(
        "simulate",
        help="compare batching policies on the real scheduler with a step-time cost model",
        description="Runs the engine's scheduler, block pool and prefix cache in virtual time. Step times "
        "come from --cost-model (fitted by `yaie bench --fit-cost-model`) or from a roofline of --model "
        "on a GPU of --bandwidth and --flops. Scenarios: static, continuous, continuous+prefix, and "
        "'+'-joined options chunk=N (token budget), pool=N (KV blocks), spec=K@A (speculative decoding).",
    )
    traffic = sim.add_argument_group("traffic")
    traffic.add_argument("--trace", type=Path, help="a JSONL trace instead of synthetic traffic")
    traffic.add_argument("--arrival", choices=("poisson", "bursty", "closed"), default="poisson")
    traffic.add_argument("--rate", type=float, default=4.0, help="requests per second (poisson, bursty)")
    traffic.add_argument("--burst-size", type=_positive_int, default=8)
    traffic.add_argument("--clients", type=_positive_int, default=8, help="closed loop: requests in flight")
    traffic.add_argument("--num-requests", type=_positive_int, default=200, help="(sessions, with --turns)")
    traffic.add_argument("--prompt-len", type=_length_range, default=(512, 2048), help="LOW:HIGH tokens")
    traffic.add_argument("--output-len", type=_length_range, default=(128, 512), help="LOW:HIGH tokens")
    traffic.add_argument("--shared-prefix", type=float, default=0.0, help="share of each prompt in common")
    traffic.add_argument("--turns", type=_positive_int, default=1, help="turns per multi-turn session")
    traffic.add_argument("--think-time", type=float, default=5.0, help="seconds between a session's turns")
    traffic.add_argument("--seed", type=int, default=0)
    cost = sim.add_argument_group("cost model and engine")
    cost.add_argument(
        "--cost-model", type=Path, help="a JSON cost model (e.g. from yaie bench --fit-cost-model)"
    )
    cost.add_argument(
        "--model", default="Llama-3-8B", help="roofline: a preset, config.json, folder or .gguf"
    )
    cost.add_argument("--memory", type=parse_bytes, default="80GiB", help="roofline: memory per GPU")
    cost.add_argument("--dtype", default="bfloat16", help="roofline: weight dtype")
    cost.add_argument("--kv-cache-dtype", default="auto")
    cost.add_argument("--tensor-parallel-size", type=_positive_int, default=1)
    cost.add_argument("--bandwidth", type=float, default=3.35e12, help="roofline: bytes/s per GPU (H100)")
    cost.add_argument("--flops", type=float, default=989e12, help="roofline: FLOP/s per GPU (H100 bf16)")
    cost.add_argument("--num-kv-blocks", type=_positive_int, help="default: the cost model's or the plan's")
    cost.add_argument("--block-size", type=_positive_int)
    cost.add_argument("--max-num-seqs", type=_positive_int)
    cost.add_argument("--max-num-batched-tokens", type=_positive_int)
    cost.add_argument("--draft-cost-ratio", type=float, default=0.05, help="spec=K@A: draft / target step")
    sim.add_argument(
        "--compare", default="static,continuous,continuous+prefix", help="comma-separated scenarios"
    )
    sim.add_argument("--json", action="store_true", help="print the summaries as JSON")
    sim.add_argument("--plot", type=Path, help="write TTFT / latency CDFs and KV use over time (PNG)")
    sim.set_defaults(run=run_simulate)


def run_simulate(args: argparse.Namespace) -> int:
    import json

    from yaie.simulate import (
        CostModel,
        EngineSettings,
        Scenario,
        TrafficSpec,
        load_trace,
        plot,
        simulate,
        summarize,
        synthetic_traffic,
    )

    scenarios = [Scenario.parse(text) for text in args.compare.split(",") if text.strip()]
    if args.cost_model:
        cost = CostModel.load(args.cost_model)
    else:
        from yaie.plan import load_model_source, make_plan

        planned = make_plan(
            load_model_source(args.model),
            dtype=args.dtype,
            kv_cache_dtype=args.kv_cache_dtype,
            memory=args.memory,
            tensor_parallel_size=args.tensor_parallel_size,
            block_size=args.block_size or 16,
        )
        cost = CostModel.roofline(planned, args.bandwidth, args.flops)
    engine = cost.engine
    if args.num_kv_blocks is None and "num_kv_blocks" not in engine:
        raise ValueError("the cost model names no KV pool size: pass --num-kv-blocks")
    settings = EngineSettings(
        num_kv_blocks=args.num_kv_blocks or int(engine["num_kv_blocks"]),
        block_size=args.block_size or int(engine.get("block_size", 16)),
        max_num_seqs=args.max_num_seqs or int(engine.get("max_num_seqs", 64)),
        max_num_batched_tokens=args.max_num_batched_tokens or int(engine.get("max_num_batched_tokens", 2048)),
        draft_cost_ratio=args.draft_cost_ratio,
    )
    if args.trace:
        traffic = load_trace(
            args.trace, clients=args.clients if args.arrival == "closed" else None, seed=args.seed
        )
    else:
        traffic = synthetic_traffic(
            TrafficSpec(
                num_requests=args.num_requests,
                arrival=args.arrival,
                rate=args.rate,
                burst_size=args.burst_size,
                clients=args.clients,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                shared_prefix=args.shared_prefix,
                turns=args.turns,
                think_s=args.think_time,
                seed=args.seed,
            )
        )
    results = [simulate(traffic, scenario, settings, cost, seed=args.seed) for scenario in scenarios]
    summaries = [summarize(result) for result in results]
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(
            json.dumps(
                {"settings": settings.__dict__, "cost_model": cost.to_json(), "scenarios": summaries},
                indent=2,
            )
        )
        return 0
    if not console.is_terminal:
        console.width = max(console.width, 150)  # the table is wide; keep it whole in logs and pipes
    table = Table(title=f"simulated: {len(traffic.requests)} requests, {settings.num_kv_blocks:,} KV blocks")
    for header in (
        "scenario",
        "out tok/s",
        "TTFT p50 s",
        "p99",
        "TPOT p50 ms",
        "e2e p50 s",
        "p99",
        "prefix hit",
        "KV peak",
        "preempt",
    ):
        table.add_column(header, justify="left" if header == "scenario" else "right")
    for s in summaries:
        table.add_row(
            escape(s["scenario"]),
            f"{s['output_tok_s']:,.1f}",
            f"{s['ttft_p50_s']:.3f}",
            f"{s['ttft_p99_s']:.3f}",
            f"{s['tpot_p50_s'] * 1e3:.2f}" if s["tpot_p50_s"] is not None else "-",
            f"{s['e2e_p50_s']:.2f}",
            f"{s['e2e_p99_s']:.2f}",
            f"{s['prefix_hit_rate']:.0%}",
            f"{s['kv_usage_peak']:.0%}",
            str(s["num_preemptions"]),
        )
    console.print(table)
    if args.plot:
        console.print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
