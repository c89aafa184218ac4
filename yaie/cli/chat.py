"""`yaie chat`: a conversation in the terminal, answered by an engine in this process or by a server."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

from rich.markup import escape

from yaie.cli.engine_args import add_engine_args
from yaie.cli.local_engine import load_engine, stream_text
from yaie.cli.options import positive_int
from yaie.cli.terminal import console
from yaie.errors import YaieError
from yaie.sampling_params import SamplingParams

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chat = commands.add_parser("chat", help="chat in the terminal, with a local model or a server")
    chat.add_argument("model", nargs="?", help="local: model path (default: bundled); with --url: model name")
    chat.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000/v1")
    chat.add_argument(
        "--api-key", default=os.environ.get("YAIE_API_KEY"), help="for --url [env: YAIE_API_KEY]"
    )
    chat.add_argument("--system", help="system prompt")
    chat.add_argument("--max-tokens", type=positive_int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    add_engine_args(chat)
    chat.set_defaults(run=run)


class LocalChat:
    """Answers from an Engine in this process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.engine = load_engine(args)
        self.name = self.engine.model_info.path.stem

    def stream(self, messages: list[dict[str, str]], max_tokens: int, temperature: float) -> Iterator[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature)
        return stream_text(self.engine, self.engine.encode_chat(messages), params)


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
            messages=cast("list[ChatCompletionMessageParam]", messages),  # our dicts are these
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
        )
        with stream:  # when stopped early, closing the connection aborts the request
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content


def run(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):
        import readline  # noqa: F401  (line editing and input history for input())

    backend: LocalChat | RemoteChat = RemoteChat(args) if args.url else LocalChat(args)
    errors: tuple[type[Exception], ...] = (YaieError,)  # a refused or failed request
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
