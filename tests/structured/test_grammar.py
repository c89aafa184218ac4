"""The pieces without a server: StructuredOutputs, the compiler and matchers over the bundled
model's tokenizer (no model weights), the sampler's grammar mask, and the tool-call format."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import torch

from tests.structured.grammar_helpers import allowed_ids
from yaie.errors import InvalidRequestError
from yaie.sampling.processors import NEG_INF, GrammarMask, build_processors
from yaie.sampling.sampler import Sampler
from yaie.sampling_params import SamplingParams
from yaie.structured.backend import GrammarCompiler, GrammarError, GrammarMatcher
from yaie.structured.spec import StructuredOutputs
from yaie.structured.tools import ToolCallParser, call_grammar, hermes_messages, parse_call

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}


def walk(matcher: GrammarMatcher, tokenizer: Any, text: str) -> list[bool]:
    return [matcher.accept(t) for t in tokenizer(text, add_special_tokens=False).input_ids]


# -- StructuredOutputs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"regex": "a", "choice": ["x"]}, {"choice": []}, {"choice": ["a", ""]}, {"regex": ""}],
)
def test_exactly_one_valid_constraint(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputs(**kwargs)
    assert info.value.param == "structured_outputs"


def test_key_keeps_property_order() -> None:
    first = StructuredOutputs(json={"properties": {"a": {}, "b": {}}})
    second = StructuredOutputs(json={"properties": {"b": {}, "a": {}}})
    assert first.key != second.key
    assert first.key == StructuredOutputs(json=json.dumps({"properties": {"a": {}, "b": {}}})).key


# -- the compiler and its matchers ----------------------------------------------------------------


def test_every_test_schema_compiles_and_accepts_a_valid_instance(
    compiler: GrammarCompiler, tokenizer: Any, schemas: list[dict[str, Any]]
) -> None:
    person = next(entry["schema"] for entry in schemas if entry["name"] == "person")
    matcher = compiler.compile(StructuredOutputs(json=person)).matcher()
    assert all(walk(matcher, tokenizer, '{"name": "Ada", "age": 36}'))
    assert matcher.accept(tokenizer.eos_token_id) and matcher.is_terminated()
    for entry in schemas:
        compiler.compile(StructuredOutputs(json=entry["schema"])).matcher()


def test_mask_allows_only_what_the_grammar_accepts(compiler: GrammarCompiler, tokenizer: Any) -> None:
    matcher = compiler.compile(StructuredOutputs(choice=["yes", "no"])).matcher()
    allowed = {tokenizer.decode([t]) for t in allowed_ids(matcher).tolist()}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    assert all(walk(matcher, tokenizer, "no"))
    assert allowed_ids(matcher).tolist() == [tokenizer.eos_token_id]  # complete: only the end


def test_matcher_refuses_a_wrong_token_and_rolls_back(compiler: GrammarCompiler, tokenizer: Any) -> None:
    matcher = compiler.compile(StructuredOutputs(regex="[0-9]{3}")).matcher()
    assert all(walk(matcher, tokenizer, "12"))
    before = allowed_ids(matcher).tolist()
    assert all(walk(matcher, tokenizer, "3"))
    matcher.rollback(1)
    assert allowed_ids(matcher).tolist() == before
    assert not walk(matcher, tokenizer, "x")[0]


def test_matchers_of_one_grammar_are_independent(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = compiler.compile(StructuredOutputs(regex="a+b"))
    first, second = grammar.matcher(), grammar.matcher()
    assert all(walk(first, tokenizer, "aab"))
    assert not second.is_terminated() and all(walk(second, tokenizer, "a"))
    assert compiler.compile(StructuredOutputs(regex="a+b")) is grammar  # cached


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutputs(regex="[a-"), "regex is invalid"),
        (StructuredOutputs(json={"type": "frobnicate"}), "the schema is invalid"),
        (StructuredOutputs(json="{not json"), "Expecting"),
        (StructuredOutputs(json="[1, 2]"), "must be a JSON object"),
        (StructuredOutputs(grammar="start: (("), "grammar is invalid"),
    ],
)
def test_invalid_constraints_are_request_errors(
    compiler: GrammarCompiler, spec: StructuredOutputs, message: str
) -> None:
    with pytest.raises(GrammarError) as info:
        compiler.compile(spec, param="response_format")
    assert info.value.param == "response_format"
    assert message in info.value.message and info.value.message.startswith("response_format: ")


# -- the sampler's mask ---------------------------------------------------------------------------


@dataclass
class Row:
    sampling_params: SamplingParams
    grammar: GrammarMatcher | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None


def test_grammar_mask_touches_constrained_rows_only(compiler: GrammarCompiler, tokenizer: Any) -> None:
    spec = StructuredOutputs(choice=["yes", "no"])
    matcher = compiler.compile(spec).matcher()
    rows = [
        Row(SamplingParams(temperature=0)),
        Row(SamplingParams(temperature=0, structured_outputs=spec), matcher),
        Row(SamplingParams(temperature=0.7)),
    ]
    processors = build_processors(rows, [], torch.device("cpu"))
    assert [type(p) for p in processors] == [GrammarMask]
    assert build_processors([rows[0], rows[2]], [], torch.device("cpu")) == []  # nothing to pay

    logits = torch.randn(3, len(tokenizer))
    work = logits.clone()
    processors[0].apply(work)
    assert torch.equal(work[0], logits[0]) and torch.equal(work[2], logits[2])
    allowed = allowed_ids(matcher)
    assert torch.equal(work[1, allowed], logits[1, allowed])
    banned = torch.ones(len(tokenizer), dtype=torch.bool)
    banned[allowed] = False
    assert bool((work[1, banned] == NEG_INF).all())

    # Sampled or greedy, the constrained row draws an allowed token whatever its logits say.
    sampler = Sampler()
    for params in (SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_p=0.9)):
        row = Row(SamplingParams(**{**vars(params), "structured_outputs": spec}), matcher)
        for _ in range(5):
            token = sampler.sample(
                torch.randn(1, len(tokenizer)), sampler.prepare([row], torch.device("cpu"))
            )
            [[drawn]] = token.token_ids  # one row, one token
            assert drawn in allowed.tolist()


def test_each_constrained_row_gets_its_own_mask(compiler: GrammarCompiler, tokenizer: Any) -> None:
    specs = [
        StructuredOutputs(choice=["yes", "no"]),
        StructuredOutputs(regex="[0-9]+"),
        StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string"}}}),
    ]
    matchers = [compiler.compile(spec).matcher() for spec in specs * 3]
    walk(matchers[-1], tokenizer, '{"a": "x')  # not all at their start
    rows = [
        Row(SamplingParams(temperature=0, structured_outputs=spec), matcher)
        for spec, matcher in zip(specs * 3, matchers, strict=True)
    ]
    [mask] = build_processors(rows, [], torch.device("cpu"))
    work = torch.zeros(len(rows), len(tokenizer))
    mask.apply(work)
    for row, matcher in enumerate(matchers):
        allowed = torch.zeros(len(tokenizer), dtype=torch.bool)
        allowed[allowed_ids(matcher)] = True
        assert torch.equal(work[row] == 0, allowed), row
    assert not torch.equal(work[0], work[1]) and not torch.equal(work[2], work[8])


# -- tools ----------------------------------------------------------------------------------------


def test_call_grammar_gives_only_valid_calls(compiler: GrammarCompiler, tokenizer: Any) -> None:
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    any_tool = compiler.compile(call_grammar([WEATHER, ADD]), param="tools").matcher()
    assert all(walk(any_tool, tokenizer, text)) and any_tool.is_terminated()
    named = compiler.compile(call_grammar([WEATHER, ADD], "get_weather"), param="tools").matcher()
    assert not all(walk(named, tokenizer, text))


def test_parser_splits_content_and_calls_at_any_chunking() -> None:
    text = (
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call> <toolbox>'
    )
    for size in (1, 3, 7, len(text)):
        parser = ToolCallParser()
        events = []
        for start in range(0, len(text), size):
            events += parser.feed(text[start : start + size])
        events += parser.finish()
        content = "".join(value for kind, value in events if kind == "content")
        calls = [value for kind, value in events if kind == "call"]
        assert content == "Let me check.  <toolbox>"
        assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [
            (0, "get_weather", {"city": "Paris"}),
            (1, "add", {"a": 1, "b": 2}),
        ]


def test_parser_gives_back_blocks_that_are_not_calls() -> None:
    parser = ToolCallParser()
    events = parser.feed('<tool_call>not json</tool_call><tool_call>{"name": ')
    events += parser.finish()
    assert events == [("content", "<tool_call>not json</tool_call>"), ("content", '<tool_call>{"name": ')]
    assert parser.num_calls == 0
    assert parse_call('{"name": "f", "arguments": [1]}') is None


def test_hermes_rendering() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    rendered = hermes_messages(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n")
    assert json.dumps(WEATHER) in rendered[0]["content"]
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert rendered[2] == {"role": "assistant", "content": call}
    assert rendered[3] == {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}
    assert hermes_messages(messages[1:2], [WEATHER])[0]["role"] == "system"  # a new system message
    assert hermes_messages(messages[:2], None) == messages[:2]  # no tools: nothing added


def test_a_valid_call_validates_against_its_tool() -> None:
    call = parse_call('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert call is not None
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
