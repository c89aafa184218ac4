"""The `yaie` command: `generate` once, `serve` the OpenAI API, `chat` in a terminal, `bench` a server,
`plan` a model's memory, `simulate` batching policies. One module per subcommand, each adding its
parser and its `run`; the only part of yaie that draws a terminal UI."""

from __future__ import annotations

import argparse

from rich.markup import escape

import yaie
from yaie.cli import bench, chat, generate, plan, serve, simulate
from yaie.cli.terminal import err_console
from yaie.errors import YaieError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="yaie", description="Yet Another Inference Engine")
    parser.add_argument("--version", action="version", version=f"yaie {yaie.__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in (generate, serve, chat, bench, plan, simulate):
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.serve_args = extra  # `yaie bench` hands the options it does not know to `yaie serve`
    try:
        result: int = args.run(args)
        return result
    except (YaieError, ValueError) as exc:  # a model we cannot load, a configuration that cannot work
        err_console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    except KeyboardInterrupt:
        return 130
