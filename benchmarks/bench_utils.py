"""Helpers shared by the benchmark scripts: how busy the machine was, and the report header.

The machines we measure on are shared: other processes (and the hypervisor, as steal time)
take CPU from a benchmark at random, and a 2-thread PyTorch job slows down far more than
proportionally when one of two cores is taken. `background_cores` says how many cores *other*
work kept busy during a measurement; `run_undisturbed` repeats a measurement that was disturbed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from rich.console import Console

from yaie.config import QUANTIZATIONS, EngineConfig

if TYPE_CHECKING:
    from yaie import LLM


@dataclass(frozen=True)
class CpuSample:
    wall_s: float
    busy_s: float  # CPU time of the whole machine that was not idle, steal included
    own_s: float  # CPU time of this process, all threads, and of its children it has waited for


def cpu_sample() -> CpuSample:
    with open("/proc/stat") as stat:
        # cpu  user nice system idle iowait irq softirq steal ...  (in clock ticks)
        ticks = [int(value) for value in stat.readline().split()[1:9]]
    idle = ticks[3] + ticks[4]
    times = os.times()
    return CpuSample(
        time.perf_counter(),
        (sum(ticks) - idle) / os.sysconf("SC_CLK_TCK"),
        times.user + times.system + times.children_user + times.children_system,
    )


def background_cores(start: CpuSample, end: CpuSample) -> float:
    """Cores that other processes (or the hypervisor) kept busy between two samples."""
    others = (end.busy_s - start.busy_s) - (end.own_s - start.own_s)
    return max(0.0, others) / max(end.wall_s - start.wall_s, 1e-9)


T = TypeVar("T")


@dataclass
class Undisturbed(Generic[T]):
    result: T
    background_cores: float  # during the kept attempt
    discarded: list[float]  # background cores of the attempts thrown away


def run_undisturbed(
    measure: Callable[[], T],
    max_background: float,
    retries: int,
    on_retry: Callable[[float], None] | None = None,
) -> Undisturbed[T]:
    """Call `measure`; while other processes kept more than `max_background` cores busy meanwhile,
    call it again, at most `retries` more times. The last attempt is kept whatever its load."""
    discarded: list[float] = []
    while True:
        before = cpu_sample()
        result = measure()
        busy = background_cores(before, cpu_sample())
        if busy <= max_background or len(discarded) >= retries:
            return Undisturbed(result, busy, discarded)
        discarded.append(busy)
        if on_retry is not None:
            on_retry(busy)


def child_result(command: list[str]) -> Any:
    """Run `command` (a benchmark's case, in a fresh process: OpenMP's thread pools live as long
    as the process), which prints its result as JSON on its last line of output; return it."""
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def decode_ms_per_step(llm: LLM, batch_size: int, max_tokens: int, repeats: int) -> list[float]:
    """ms per decode step of each of `repeats` generations of a batch of short prompts (greedy,
    EOS ignored, after a warm-up): a generation's wall time over `max_tokens`."""
    from yaie import SamplingParams

    prompts = [f"Tell me a story about the number {i}." for i in range(batch_size)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append((time.perf_counter() - start) / max_tokens * 1e3)
    return times


def machine_info() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def make_console() -> Console:
    """A rich console; when output goes to a file or pipe, wide enough for the result tables."""
    return Console(width=None if sys.stdout.isatty() else 120)


def add_disturbance_args(parser: argparse.ArgumentParser) -> None:
    """--max-bg-cores and --retries, the knobs of `run_undisturbed`."""
    parser.add_argument(
        "--max-bg-cores",
        type=float,
        default=0.3,
        help="redo a measurement during which other processes kept more cores than this busy",
    )
    parser.add_argument("--retries", type=int, default=2, help="redos per disturbed measurement, at most")


def add_quantization_arg(parser: argparse.ArgumentParser) -> None:
    """--quantization for the engine the script runs; the default is the engine's own."""
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=EngineConfig.quantization,
        help=f"how the engine holds the weights (default {EngineConfig.quantization}; none: dense fp32)",
    )


def write_report(path: Path, report: dict[str, Any], console: Console) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {path}")
