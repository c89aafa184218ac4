"""Option types of the `yaie` command line, and defaults read from YAIE_* environment variables."""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

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


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


class Repeatable(argparse.Action):
    """An option that may be given several times, collecting its values in a list. Given on the
    command line, its values replace the default (one value from the environment) rather than
    add to it, as every other option's do."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        collected = getattr(namespace, self.dest)
        collected = [] if collected is None or collected is self.default else collected
        setattr(namespace, self.dest, [*collected, values])


def _env_flag(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


class EnvDefaults:
    """Adds options whose defaults can come from YAIE_<OPTION> environment variables."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser

    def add(self, name: str, **kwargs: Any) -> None:
        env = "YAIE_" + name.lstrip("-").replace("-", "_").upper()
        if env in os.environ:
            value = os.environ[env]
            # argparse runs `type` over string defaults, so other values parse as on the command line.
            default: Any = value
            if kwargs.get("action") == "store_true":
                default = _env_flag(value)
            elif kwargs.get("action") is Repeatable:
                default = [value]
            kwargs["default"] = default
        kwargs["help"] = f"{kwargs.get('help', '')} [env: {env}]".strip()
        self.parser.add_argument(name, **kwargs)
