"""Putting a JSON schema inside another one so that its references still resolve.

A tool's parameters become one property of the schema of a call (yaie/structured/tools.py), and
several tools' calls one `anyOf`. References in a schema are JSON pointers from the root of
its document: `#/$defs/Address` (pydantic's), `#/definitions/Address` (before draft 2019-09,
still written by many generators), `#` (the schema itself, for a recursive one) or
`#/properties/...`. Once the schema is nested, its root is no longer the document's, so those
pointers would name places that do not exist. Pointing them below the schema's new place is
not enough for its definitions: llguidance finds `$defs` only at the root. So, as vLLM does,
the nested schema's definitions are hoisted to the root of the assembled schema, and (further
than vLLM goes) every local reference is rewritten to point at the same place as before: into
the hoisted definitions, or below the place the schema now sits at. The hoisted definitions
are named after their schema's namespace (its tool's name), since the tools of one request
often define the same names (two pydantic models that both nest an `Address`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from urllib.parse import quote, unquote

# Where a schema keeps the subschemas it refers to.
DEFINITIONS = ("$defs", "definitions")
# What names a document rather than describing a value: meaningless inside another document,
# and an `$id` would make the references below it resolve against it instead of the root.
DOCUMENT_KEYWORDS = ("$id", "$schema")
# The keywords whose values hold schemas, by shape; every other keyword's value is data (a
# `const`, `enum` or `default` may hold a "$ref" key that is not a reference).
SCHEMA_KEYWORDS = frozenset(
    {
        "additionalItems", "additionalProperties", "contains", "contentSchema", "else", "if", "items",
        "not", "propertyNames", "then", "unevaluatedItems", "unevaluatedProperties",
    }
)  # fmt: skip
SCHEMA_LIST_KEYWORDS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
SCHEMA_MAP_KEYWORDS = frozenset(
    {"$defs", "definitions", "dependencies", "dependentSchemas", "patternProperties", "properties"}
)

Path = Sequence[str | int]  # a place in a schema, as the tokens of a JSON pointer


class Definitions:
    """The `$defs` of a schema assembled from others: `nest` hoists each nested schema's
    definitions here, and `attach` puts them at the root of the assembled schema."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}

    def nest(self, schema: Any, at: Path, namespace: str) -> Any:
        """`schema` as it must be written at the place `at` of the assembled schema: without its
        definitions (hoisted here, named "<namespace>.<name>") and with each of its local
        references pointing at the same place as before."""
        if not isinstance(schema, dict):
            return schema  # true or false: nothing to refer to
        hoisted = {
            (keyword, name): self._reserve(f"{namespace}.{name}")
            for keyword in DEFINITIONS
            if isinstance(schema.get(keyword), dict)
            for name in schema[keyword]
        }
        rewriter = _RefRewriter([str(token) for token in at], hoisted)
        for (keyword, name), new_name in hoisted.items():
            self.schemas[new_name] = rewriter.schema(schema[keyword][name])
        dropped = {keyword for keyword, _ in hoisted}.union(DOCUMENT_KEYWORDS)
        body = {key: value for key, value in schema.items() if key not in dropped}
        return rewriter.schema(body)

    def attach(self, schema: dict[str, Any]) -> dict[str, Any]:
        """`schema` (the assembled one) with the hoisted definitions at its root."""
        return {**schema, "$defs": self.schemas} if self.schemas else schema

    def _reserve(self, name: str) -> str:
        """`name`, or a variant of it, not yet taken (a request may repeat a tool's name)."""
        free, number = name, 1
        while free in self.schemas:
            number += 1
            free = f"{name}.{number}"
        self.schemas[free] = None  # filled in by `nest`
        return free


class _RefRewriter:
    """Rewrites the local references of one nested schema (see `Definitions.nest`)."""

    def __init__(self, base: list[str], hoisted: dict[tuple[str, str], str]) -> None:
        self._base = base  # where the nested schema's root now is
        self._hoisted = hoisted  # (keyword, name) -> its name in the root's $defs

    def schema(self, node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        rewritten: dict[str, Any] = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                value = self._ref(value)
            elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                value = {name: self.schema(subschema) for name, subschema in value.items()}
            elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
                value = [self.schema(subschema) for subschema in value]
            elif key in SCHEMA_KEYWORDS:
                value = self.schema(value)
            rewritten[key] = value
        return rewritten

    def _ref(self, ref: str) -> str:
        """`ref` pointing into the assembled schema. References to other documents, and to
        named anchors (`#name`), are left as they are."""
        if not ref.startswith("#") or ref[1:2] not in ("", "/"):
            return ref
        tokens = [unescape(token) for token in ref[1:].split("/")[1:]]
        hoisted = self._hoisted.get((tokens[0], tokens[1])) if len(tokens) >= 2 else None
        tokens = ["$defs", hoisted, *tokens[2:]] if hoisted is not None else [*self._base, *tokens]
        return "#" + "".join(f"/{escape(token)}" for token in tokens)


def unescape(token: str) -> str:
    """A JSON pointer token of a URI fragment, decoded (RFC 6901: percent-encoding, then ~1 and ~0)."""
    return unquote(token).replace("~1", "/").replace("~0", "~")


def escape(token: str) -> str:
    return quote(token.replace("~", "~0").replace("/", "~1"), safe="!$&'()*+,;=:@")
