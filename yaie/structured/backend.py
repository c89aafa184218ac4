"""The grammar library behind one small interface: `GrammarCompiler.compile(spec) -> Grammar`,
`Grammar.matcher() -> GrammarMatcher`, and a matcher that fills its row of a token bitmask,
accepts the sampled token, says when it is terminated and rolls back.

The library is llguidance (docs/structured-outputs.md, "Why llguidance", has the measurements
behind the choice): it builds its lexer lazily, so a new schema costs little before its first
mask, where xgrammar precomputes per-schema token tables first. Lazily, too, it may meet one of
its limits only once the output gets somewhere: compiling walks a new grammar into its output
to find that at admission (probe.py), and a limit met later still fails its request as the
client's input (GrammarError), never as the engine's failure.

A bitmask row holds one bit per token, 32 tokens per int32 (token t is bit t % 32 of word
t // 32), set when the token is allowed.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import torch

from yaie.errors import InvalidRequestError
from yaie.structured import probe
from yaie.structured.spec import PARAM, StructuredOutputs

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # a TypedDict of the stubs only

CACHE_SIZE = 256  # compiled grammars kept, most recently used first
# Compact JSON, as OpenAI writes it: with free whitespace a small model can loop on newlines
# until max_tokens, while the content of the JSON is the same either way.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# The parser's state in an error message is for the library's developers, not for a client.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)


class GrammarError(InvalidRequestError):
    """A schema, regex or grammar the library refuses, or cannot run; names the request's field."""


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, kind: str) -> None:
        self._matcher = matcher  # an llguidance.LLMatcher
        self.vocab_size = vocab_size
        self._kind = kind  # what the constraint is, for errors: "the schema", "the regex"...

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32, CPU, contiguous)."""
        target = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        self._raise_on_error()

    def accept(self, token_id: int) -> bool:
        """Advance by the sampled token; False if the grammar does not allow it (`failure`
        says why)."""
        return bool(self._matcher.consume_token(token_id))

    def failure(self) -> Exception:
        """Why the matcher failed: a GrammarError when the library met one of its limits (the
        client's schema or grammar is more than it can run), else a RuntimeError (the
        library's failure, or ours: it refused a token its own mask allowed)."""
        error, stop_reason = self.error, str(self._matcher.stop_reason())
        message = probe.limit_message(error, stop_reason)
        if message is not None:
            return GrammarError(f"{PARAM}: {self._kind} {message}", PARAM)
        return RuntimeError(f"the grammar matcher failed ({stop_reason}): {probe.clean(error)}")

    def is_terminated(self) -> bool:
        """The grammar is complete and takes no more tokens (after EOS, or when nothing can follow)."""
        return bool(self._matcher.is_stopped())

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (for speculative decoding's rejected drafts)."""
        if not self._matcher.rollback(num_tokens):
            self._raise_on_error()

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())

    def _raise_on_error(self) -> None:
        if self._matcher.is_error():
            raise self.failure()


class Grammar:
    """A compiled constraint: a matcher at its start, copied for each sequence."""

    def __init__(self, prototype: Any, vocab_size: int, kind: str) -> None:
        self._prototype = prototype
        self.vocab_size = vocab_size
        self._kind = kind

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._prototype.deep_copy(), self.vocab_size, self._kind)


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer, caching the results by their key.

    Thread-safe: the server compiles on its tokenizer threads while the engine thread makes
    matchers. `eos_token_ids` are the tokens that end a sequence; the grammar allows them once
    it is complete.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self._walker = probe.Walker(self._tokenizer, vocab_size, eos_token_ids)
        self._cache: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs, param: str = PARAM) -> Grammar:
        """The grammar for `spec`; raises GrammarError (naming `param`) for one the library refuses."""
        key = spec.key
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(spec, param)  # outside the lock: others' cache hits go on
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, spec: StructuredOutputs, param: str) -> Grammar:
        kind = _kind(spec)
        try:
            text = grammar_text(spec)
        except (ValueError, TypeError) as exc:
            raise GrammarError(f"{param}: {exc}", param) from exc
        except RecursionError as exc:  # JSON text nested too deep for Python's reader
            raise GrammarError(f"{param}: {kind} {probe.TOO_DEEP}", param) from exc
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=LIMITS)
        error = (
            self._error(matcher, kind, param, invalid=True)
            or self._probe(matcher.deep_copy(), kind, param)
            or self._probe_parts(spec, param)
        )
        if error is not None:
            raise error
        return Grammar(matcher, self.vocab_size, kind)

    def _probe(self, matcher: Any, kind: str, param: str) -> GrammarError | None:
        """Walk `matcher` (changed) into its output; the error for a limit it meets there."""
        self._walker.walk(matcher)
        return self._error(matcher, kind, param, invalid=False)

    def _probe_parts(self, spec: StructuredOutputs, param: str) -> GrammarError | None:
        """Walk each wide part of the JSON schemas `spec` holds alone (probe.wide_parts); the
        error for the first limit one meets."""
        for pointer, part in _wide_parts(spec):
            text = llguidance.LLMatcher.grammar_from_json_schema(part, defaults=JSON_OPTIONS)
            matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=LIMITS)
            # A part alone may not compile where the whole does (a reference relative to the
            # whole, say): only a limit it meets is the whole's.
            if matcher.is_error():
                continue
            error = self._probe(matcher, f"the schema's part at {pointer}", param)
            if error is not None:
                return error
        return None

    @staticmethod
    def _error(matcher: Any, kind: str, param: str, invalid: bool) -> GrammarError | None:
        """The GrammarError for `matcher`'s error, if it has one: a limit it met (the library's
        sentence for it), else, when `invalid` says its other errors are the client's, what
        is wrong with the constraint."""
        if not matcher.is_error():
            return None
        error = str(matcher.get_error())
        message = probe.limit_message(error, str(matcher.stop_reason()))
        if message is not None:
            return GrammarError(f"{param}: {kind} {message}", param)
        if invalid:
            return GrammarError(f"{param}: {kind} is invalid: {probe.clean(error)}", param)
        # Not a limit: the library failed on a grammar it accepted, which is no fault of the client's.
        raise RuntimeError(f"the grammar library failed on a grammar it compiled: {probe.clean(error)}")


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar for `spec` (ValueError for a schema that is not JSON)."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be a JSON object")
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))
    if spec.json_object:
        return str(llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS))
    if spec.regex is not None:
        return str(llguidance.LLMatcher.grammar_from_regex(spec.regex))
    if spec.choice is not None:
        # JSON string literals are Lark string literals.
        alternatives = " | ".join(json.dumps(choice) for choice in spec.choice)
        return str(llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}"))
    assert spec.grammar is not None
    return str(llguidance.LLMatcher.grammar_from_lark(spec.grammar))


def _kind(spec: StructuredOutputs) -> str:
    """What the constraint is, as errors name it."""
    if spec.json is not None or spec.json_object:
        return "the schema"
    if spec.choice is not None:
        return "the choice"
    return f"the {spec.key[0]}"


def _wide_parts(spec: StructuredOutputs) -> list[tuple[str, dict[str, Any]]]:
    """The wide parts of the JSON schemas `spec` holds (probe.wide_parts): its own, or those a
    grammar embeds (a tool call's)."""
    if spec.json is not None:
        schemas = [json.loads(spec.json) if isinstance(spec.json, str) else spec.json]
    elif spec.grammar is not None:
        schemas = probe.json_schemas_in(spec.grammar)
    else:
        return []
    return [part for schema in schemas for part in probe.wide_parts(schema)]
