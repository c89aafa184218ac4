"""Exceptions a caller can act on. Each maps to one HTTP status in the server."""

from __future__ import annotations


class YaieError(Exception):
    """Base class for errors raised by yaie on purpose."""


class InvalidRequestError(YaieError, ValueError):
    """A request the engine refuses: bad parameter values, an empty or too long prompt.

    `param` names the offending field (OpenAI's error body carries it).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class RequestFailedError(YaieError):
    """The engine failed while running this request; other requests go on (HTTP 500)."""


class ModelLoadError(YaieError):
    """The model path does not exist or holds nothing we can load."""


class UnsupportedModelError(ModelLoadError):
    """The model exists but its architecture or tensor format is not implemented."""
