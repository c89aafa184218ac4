"""What a request asks its output to match: `StructuredOutputs`, named as in vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object), and `ToolCallSpans`, where
free text may hold tool calls. Plain data, checked for shape here; whether a schema, regex or
grammar is valid only the grammar library can tell (backend.py), off the engine thread."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from yaie.errors import InvalidRequestError

PARAM = "structured_outputs"
MAX_CHOICES = 1024


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of the constraints. `json` is a JSON schema (a dict, or its JSON text);
    `grammar` is a Lark grammar as llguidance reads it (start rule `start`); `json_object`
    asks for any JSON object."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [
            name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise InvalidRequestError(
                f"{PARAM}: give exactly one of json, regex, choice, grammar or json_object, got "
                f"{', '.join(given) or 'none'}",
                PARAM,
            )
        if self.choice is not None and (
            not self.choice
            or len(self.choice) > MAX_CHOICES
            or any(not isinstance(c, str) or not c for c in self.choice)
        ):
            raise InvalidRequestError(f"{PARAM}: choice must be 1 to {MAX_CHOICES} non-empty strings", PARAM)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{PARAM}: {name} must be a non-empty string", PARAM)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by: the kind and its canonical text."""
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json.dumps(self.json)
            return "json", text
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        if self.grammar is not None:
            return "grammar", self.grammar
        return "json_object", ""


@dataclass(frozen=True)
class ToolCallSpans:
    """Free text that may hold tool calls (tool_choice "auto"): written in `format`'s syntax
    (a `ToolFormat`'s name, yaie/structured/tool_formats.py), calling the tools named `names`.
    Stop strings and stop tokens apply to the text around the calls, never inside one, so that
    a call the server parses out of the text afterwards is never cut short."""

    format: str
    names: tuple[str, ...]
