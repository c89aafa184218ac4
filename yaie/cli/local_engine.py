"""An engine in this process, for `generate` and `chat`: loaded under a progress bar, and the
one loop that runs a request on it, streaming its text."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from yaie.cli.engine_args import engine_config
from yaie.cli.terminal import loading_bar, log_to_terminal
from yaie.engine.engine import Engine
from yaie.sampling_params import SamplingParams


def load_engine(args: argparse.Namespace) -> Engine:
    log_to_terminal()
    with loading_bar() as progress:
        return Engine(engine_config(args), load_progress=progress)


def stream_text(engine: Engine, prompt: str | list[int], params: SamplingParams) -> Iterator[str]:
    """Run one request on `engine`, the only one it holds, yielding its text as it grows."""
    request_id = engine.add_request(None, prompt, params)
    try:
        finished = False
        while not finished:
            for output in engine.step():
                if output.error is not None:  # the request failed (and only it)
                    raise output.error
                yield output.outputs[0].delta_text
                finished = output.finished
    finally:
        engine.abort(request_id)  # when stopped early (Ctrl-C); a finished request is already gone
