"""Finding, when a constraint is compiled, what the grammar library cannot run.

llguidance builds its parser lazily, so a grammar it accepts may still hit one of its limits
(`LLParserLimits`) only once the output reaches some point of it. The one real schemas hit is
the parser's row of items: an object with hundreds of optional properties, or an anyOf of many
objects, leaves the parser expecting thousands of things right after the object's `{` (2,000
items is the limit), and the library gives up there, at the first token or some later one. So
that such a request is refused at admission, with a 400, rather than failing once it runs:

- a new grammar is walked a few tokens into its output (`Walker`), computing the mask and
  advancing the parser as generation would: the first mask, the first `{`, the first property;
- each wide part of a JSON schema (an object with many optional properties, an anyOf of many
  alternatives: `wide_parts`), wherever it sits, is compiled alone and walked the same way,
  since the items pile up at its own start.

The walk is a probe, not a proof: what it misses surfaces while the request runs, and fails that
request alone with the same sentence (`limit_message`), as a 400 for the client's input.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np

from yaie.structured.nested_schema import (
    DEFINITIONS,
    SCHEMA_KEYWORDS,
    SCHEMA_LIST_KEYWORDS,
    SCHEMA_MAP_KEYWORDS,
    escape,
    unescape,
)

PROBE_TOKENS = 16  # how far into its output a new grammar is walked
# A part of a schema the parser may expect this many things of at once (optional properties,
# alternatives) is walked alone. The parser's limit is 2,000 items, about 4 per optional
# property, so a part narrower than this is nowhere near it.
WIDE = 64
MAX_PARTS = 8  # the widest parts walked, at most

# Tokens the walk takes when the mask allows them, first first: those that close what is open
# (a string, an object, an array) or are a whole value, so that the walk goes through a schema's
# structure (past a property's value to where the next ones are expected) rather than staying
# inside one string.
PREFERRED = ('"', "}", "]", "0")

TOO_DEEP = (
    "nests too deeply for the grammar library, which reads JSON at most 128 levels deep (each "
    "object and array is a level, and the library wraps a schema in three of its own)"
)
# The library's errors for its limits (llguidance 1.9's wording), and what a client is told:
# what ran out, and the limit. Its other errors say what is wrong with a schema or grammar.
LIMITS = (
    (
        r"Current row has (\d+) items; max is (\d+)",
        "is too complex for the grammar library: at one point of the output its parser would "
        "expect {0} items at once, over the library's limit of {1} (an object with hundreds of "
        "optional properties, or an anyOf of many objects, does this: make more properties "
        "required, or offer fewer alternatives)",
    ),
    (
        r"Too many items \(limit (\d+)",
        "is too complex for the grammar library: one token would take its parser over {0} items, "
        "the library's limit for one step",
    ),
    (
        r"too many states: \d+ >= (\d+)",
        "needs more than {0} lexer states, the grammar library's limit (long patterns or long "
        "bounded repetitions do this)",
    ),
    (
        r"too many expressions constructed|fuel exhausted|lexer precomputation failed"
        r"|initial lexer configuration \(grammar\) too big",
        "has patterns too complex for the grammar library's lexer: building them takes more "
        "than the library's limit on that work",
    ),
    (
        r"grammar size \(number of symbols\) too big \(limit for this grammar: (\d+)\)",
        "is too large for the grammar library: more than its limit of {0} grammar symbols",
    ),
    (
        r"schema too large",
        "is too large for the grammar library: it has more than the 50,000 parts the library "
        "compiles at most (a property is several)",
    ),
    (r"recursion limit exceeded", TOO_DEEP),
)
# The library's stop reasons for its limits, for an error not worded as above.
LIMIT_STOPS = frozenset({"ParserTooComplex", "LexerTooComplex"})


def limit_message(error: str, stop_reason: str) -> str | None:
    """The predicate of a sentence (after "the schema", "the grammar"...) for an error of the
    library that is one of its limits; None for any other error."""
    for pattern, message in LIMITS:
        match = re.search(pattern, error)
        if match:
            return message.format(*(f"{int(number):,}" for number in match.groups()))
    if stop_reason in LIMIT_STOPS:
        return f"is too complex for the grammar library ({clean(error)})"
    return None


def clean(error: str) -> str:
    """The library's error without the parser's state it may append (in `<state>` or
    `<non-verbose/>` sections, after the first line)."""
    return error.split("\n<", 1)[0].strip()


class Walker:
    """Walks a matcher through the first tokens of its output: at each step, the first token of
    PREFERRED that its mask allows, else the allowed token with the lowest id (byte-level
    vocabularies put single characters first), EOS last."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        """`tokenizer`: the llguidance.LLTokenizer the matchers are built with."""
        self._vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)
        encoded = [tokenizer.tokenize_str(text) for text in PREFERRED]
        self._preferred: list[int] = [ids[0] for ids in encoded if len(ids) == 1]

    def walk(self, matcher: Any, steps: int = PROBE_TOKENS) -> None:
        """Advance `matcher` (an llguidance.LLMatcher) by up to `steps` tokens, stopping at the end
        of its output or at an error, which the matcher then holds (`is_error`)."""
        mask = np.zeros(-(-self._vocab_size // 32), dtype=np.int32)
        for _ in range(steps):
            if matcher.is_stopped():
                return
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            if matcher.is_error():
                return
            token = self._choose(np.unpackbits(mask.view(np.uint8), bitorder="little"))
            if token is None or not matcher.consume_token(token):
                return

    def _choose(self, allowed: np.ndarray[Any, Any]) -> int | None:
        for token in self._preferred:
            if allowed[token]:
                return token
        tokens: list[int] = np.flatnonzero(allowed[: self._vocab_size]).tolist()
        return next((token for token in tokens if token not in self._eos), None)


def wide_parts(schema: Any) -> list[tuple[str, dict[str, Any]]]:
    """(its JSON pointer, the part alone) for the widest parts of `schema` (at most MAX_PARTS, at
    least WIDE wide), each given the root's definitions so that its references resolve. Parts
    are reached as the output can reach them: through the keywords that hold schemas and through
    references, never a definition nothing refers to. The root is not among them: it is the
    grammar's own start, walked with it."""
    found: list[tuple[int, str, dict[str, Any]]] = []
    seen = {id(schema)}
    for pointer, node in _parts(schema, schema, "#", seen):
        width = _width(node, schema)
        if width >= WIDE:
            found.append((width, pointer, node))
    found.sort(key=lambda entry: -entry[0])
    definitions = {key: schema[key] for key in DEFINITIONS if isinstance(schema, dict) and key in schema}
    return [(pointer, {**definitions, **node}) for _, pointer, node in found[:MAX_PARTS]]


def _parts(node: Any, root: Any, pointer: str, seen: set[int]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every part below `node` (at `pointer`), once each, depth first."""
    if not isinstance(node, dict):
        return
    children: list[tuple[str, Any]] = []
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str):
            children.append((value, _resolve(root, value)))
        elif key in DEFINITIONS:
            continue  # reached through the references to them
        elif key in SCHEMA_MAP_KEYWORDS and isinstance(value, dict):
            children += [(f"{pointer}/{key}/{escape(name)}", child) for name, child in value.items()]
        elif key in SCHEMA_LIST_KEYWORDS and isinstance(value, list):
            children += [(f"{pointer}/{key}/{i}", child) for i, child in enumerate(value)]
        elif key in SCHEMA_KEYWORDS:
            children.append((f"{pointer}/{key}", value))
    for child_pointer, child in children:
        if isinstance(child, dict) and id(child) not in seen:
            seen.add(id(child))
            yield child_pointer, child
            yield from _parts(child, root, child_pointer, seen)


def _width(node: dict[str, Any], root: Any) -> int:
    """About how many things the parser expects at once at the start of `node`: its optional
    properties, and its alternatives with theirs."""
    width = _optional_properties(node)
    for key in ("anyOf", "oneOf"):
        alternatives = node.get(key)
        if isinstance(alternatives, list):
            for alternative in alternatives:
                if isinstance(alternative, dict) and isinstance(alternative.get("$ref"), str):
                    alternative = _resolve(root, alternative["$ref"])
                width += 1 + (_optional_properties(alternative) if isinstance(alternative, dict) else 0)
    return width


def _optional_properties(node: dict[str, Any]) -> int:
    properties, required = node.get("properties"), node.get("required")
    if not isinstance(properties, dict):
        return 0
    names = {name for name in required if isinstance(name, str)} if isinstance(required, list) else set()
    return len(properties.keys() - names)


def _resolve(root: Any, ref: str) -> Any:
    """What a local reference (`#/...`) points at in `root`; None for any other."""
    if not ref.startswith("#/") and ref != "#":
        return None
    node = root
    for token in ref[2:].split("/") if ref != "#" else []:
        token = unescape(token)
        if isinstance(node, dict):
            node = node.get(token)
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return None
    return node


def json_schemas_in(lark: str) -> list[dict[str, Any]]:
    """The JSON schemas a Lark grammar embeds (`%json {...}`, as a tool call's grammar does)."""
    decoder = json.JSONDecoder()
    schemas = []
    for match in re.finditer(r"%json\s*(?=\{)", lark):
        try:
            schema, _ = decoder.raw_decode(lark, match.end())
        except json.JSONDecodeError:
            continue  # not an embedded schema ("%json" in a string, say): the library reads it
        if isinstance(schema, dict):
            schemas.append(schema)
    return schemas
