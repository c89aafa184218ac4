"""What the command line draws on the terminal: its consoles, the library's log lines, and the
progress bar of a model loading. The library itself draws nothing."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from yaie.model.loader import LoadProgress

console = Console(highlight=False, soft_wrap=True)
err_console = Console(stderr=True, highlight=False)


def widen_for_pipes() -> None:
    """Keep wide tables whole in logs and pipes, where the console's width is only a guess."""
    if not console.is_terminal:
        console.width = max(console.width, 150)


def log_to_terminal() -> None:
    """Show what the library logs (the model and kernels loading, warnings) on stderr, as rich
    lines. Only where nothing configured logging already: `serve` sets it up its own way."""
    logging.basicConfig(
        level=logging.WARNING,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_time=False, show_path=False)],
    )
    logging.getLogger("yaie").setLevel(logging.INFO)


@contextlib.contextmanager
def loading_bar() -> Iterator[LoadProgress]:
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
