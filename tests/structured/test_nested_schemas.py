"""Tool parameters whose schema refers to itself (`$defs`/`definitions` and `$ref`, as every
pydantic model that nests another has), nested into the schema of a call: the transformation
alone (yaie/structured/nested_schema.py, judged by jsonschema), then the grammars the compiler
makes of it over the bundled model's tokenizer (no model weights), walked with valid and invalid
calls and with calls the grammar itself generates."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, create_model

from tests.structured.grammar_helpers import allowed_ids
from yaie.structured import llama3_tools, tools
from yaie.structured.backend import GrammarCompiler, GrammarMatcher
from yaie.structured.nested_schema import Definitions
from yaie.structured.spec import StructuredOutputs


class Address(BaseModel):
    street: str = Field(max_length=12)
    city: str = Field(max_length=12)


class Person(BaseModel):
    """A person and where they live."""

    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    address: Address
    friends: list[Address] = Field(max_length=2)


class Node(BaseModel):
    """A tree: a model that refers to itself."""

    value: int = Field(ge=0, le=9)
    children: list[Node] = Field(max_length=1)


class shipping:  # a namespace, as another module would be
    class Address(BaseModel):
        """Not Person's `Address`: the same name in `$defs`, another schema."""

        zip: int = Field(ge=10000, le=99999)


class Parcel(BaseModel):
    weight: int = Field(ge=1, le=99)
    to: shipping.Address


def function_tool(model: type[BaseModel]) -> dict[str, Any]:
    """The tool the openai SDK makes of `model`, as it sends it."""
    tool: dict[str, Any] = json.loads(json.dumps(openai.pydantic_function_tool(model)))
    return tool


PERSON, NODE, PARCEL = function_tool(Person), function_tool(Node), function_tool(Parcel)
# Before draft 2019-09, as zod-to-json-schema writes it (the Vercel AI SDK's): `definitions`,
# a `$schema`, and a reference to the root itself.
OUTLINE = {
    "type": "function",
    "function": {
        "name": "outline",
        "parameters": {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {
                "title": {"$ref": "#/definitions/Title"},
                "sections": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1},
                "subtitle": {"$ref": "#/properties/title"},
            },
            "required": ["title", "sections"],
            "additionalProperties": False,
            "definitions": {"Title": {"type": "string", "maxLength": 8}},
        },
    },
}
TOOLS = [PERSON, NODE, PARCEL, OUTLINE]


def parameters(tool: dict[str, Any]) -> dict[str, Any]:
    schema: dict[str, Any] = tool["function"]["parameters"]
    return schema


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            yield from refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from refs(item)


def resolve(schema: dict[str, Any], ref: str) -> Any:
    """What the local reference `ref` points to in `schema` (KeyError, IndexError if nothing)."""
    assert ref.startswith("#"), ref
    node: Any = schema
    for token in ref[1:].split("/")[1:]:
        token = unquote(token).replace("~1", "/").replace("~0", "~")
        node = node[int(token)] if isinstance(node, list) else node[token]
    return node


def is_valid(instance: Any, schema: dict[str, Any]) -> bool:
    return bool(jsonschema.Draft202012Validator(schema).is_valid(instance))


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


ALICE = Person(
    name="Alice", age=30, address=Address(street="Rue Cler", city="Paris"), friends=[]
).model_dump()
TREE = Node(value=1, children=[Node(value=2, children=[Node(value=3, children=[])])]).model_dump()
PARCEL_ARGS = {"weight": 3, "to": {"zip": 75007}}
OUTLINE_ARGS = {"title": "Intro", "sections": [{"title": "Part", "sections": [], "subtitle": "One"}]}
VALID_CALLS = [
    call("Person", ALICE),
    call("Node", TREE),
    call("Parcel", PARCEL_ARGS),
    call("outline", OUTLINE_ARGS),
]
# Each breaks its schema only below a reference: so refs that resolved to nothing, or to the
# wrong tool's definition, would let it through.
INVALID_CALLS = [
    call("Person", {**ALICE, "address": {"street": "Rue Cler", "city": 7}}),
    call("Person", {**ALICE, "address": {"zip": 75007}}),  # Parcel's Address, not Person's
    call("Node", {"value": 1, "children": [{"value": 2, "children": [{"value": "3", "children": []}]}]}),
    call("Parcel", {"weight": 3, "to": {"street": "Rue Cler", "city": "Paris"}}),  # Person's
    call("outline", {**OUTLINE_ARGS, "title": "Much too long a title"}),
    call("outline", {"title": "Intro", "sections": [{"title": "Part"}]}),  # `#`: sections required
    call("outline", {**OUTLINE_ARGS, "subtitle": 5}),
]


# -- the transformation ---------------------------------------------------------------------------


@pytest.mark.parametrize("arguments_key", ["arguments", "parameters"])
@pytest.mark.parametrize(
    "chosen", [TOOLS, [PERSON], [NODE], [OUTLINE]], ids=["all", "person", "node", "outline"]
)
def test_call_schema_keeps_every_reference(chosen: list[dict[str, Any]], arguments_key: str) -> None:
    schema = tools.call_schema(chosen, arguments_key)
    one_call = {"type", "properties", "required", "additionalProperties"}
    assert set(schema) - {"$defs"} == ({"anyOf"} if len(chosen) > 1 else one_call)
    found = list(refs(schema))
    assert found and all(resolve(schema, ref) is not None for ref in found)
    names = {tool["function"]["name"] for tool in chosen}
    jsonschema.Draft202012Validator.check_schema(schema)
    for valid in VALID_CALLS:
        instance = {"name": valid["name"], arguments_key: valid["arguments"]}
        assert is_valid(instance, schema) == (valid["name"] in names), valid
    for invalid in INVALID_CALLS:
        assert not is_valid({"name": invalid["name"], arguments_key: invalid["arguments"]}, schema), invalid


def test_the_nested_schema_means_what_it_meant_alone() -> None:
    # The calls above are judged the same by each tool's own schema, unnested.
    by_name = {tool["function"]["name"]: parameters(tool) for tool in TOOLS}
    assert all(is_valid(c["arguments"], by_name[c["name"]]) for c in VALID_CALLS)
    assert not any(is_valid(c["arguments"], by_name[c["name"]]) for c in INVALID_CALLS)


def test_definitions_are_hoisted_under_their_tool_name() -> None:
    schema = tools.call_schema([PERSON, PARCEL, OUTLINE])
    assert sorted(schema["$defs"]) == ["Parcel.Address", "Person.Address", "outline.Title"]
    assert schema["$defs"]["Person.Address"] == parameters(PERSON)["$defs"]["Address"]
    person, parcel, outline = (option["properties"]["arguments"] for option in schema["anyOf"])
    assert person["properties"]["address"] == {"$ref": "#/$defs/Person.Address"}
    assert parcel["properties"]["to"] == {"$ref": "#/$defs/Parcel.Address"}
    assert "$defs" not in person and "definitions" not in outline and "$schema" not in outline
    assert outline["properties"]["sections"]["items"] == {"$ref": "#/anyOf/2/properties/arguments"}
    assert outline["properties"]["subtitle"] == {"$ref": "#/anyOf/2/properties/arguments/properties/title"}
    # Unchanged: what the request sent (it is shown to the model as it was).
    assert "$defs" in parameters(PERSON) and parameters(OUTLINE)["properties"]["sections"]["items"] == {
        "$ref": "#"
    }


def test_recursive_definitions_refer_to_their_hoisted_selves() -> None:
    schema = tools.call_schema([NODE])
    assert schema["$defs"]["Node.Node"]["properties"]["children"]["items"] == {"$ref": "#/$defs/Node.Node"}
    assert is_valid(call("Node", TREE), schema)


def test_a_schema_that_is_only_a_reference() -> None:
    # pydantic's schema of a recursive model at the top: {"$defs": {...}, "$ref": ...}.
    tree = {"type": "function", "function": {"name": "tree", "parameters": Node.model_json_schema()}}
    schema = tools.call_schema([tree])
    assert schema["properties"]["arguments"] == {"$ref": "#/$defs/tree.Node"}
    assert is_valid(call("tree", TREE), schema)
    assert not is_valid(call("tree", {"value": 1, "children": [{"value": -1, "children": []}]}), schema)


def test_repeated_tool_names_and_names_that_need_escaping() -> None:
    odd = {"$defs": {"a/b": {"type": "integer"}, "c~d e": {"type": "string"}}, "type": "object",
           "properties": {"x": {"$ref": "#/$defs/a~1b"}, "y": {"$ref": "#/$defs/c~0d%20e"}}}  # fmt: skip
    other = {
        "$defs": {"a/b": {"type": "string"}},
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/a~1b"}},
    }
    twins = [{"type": "function", "function": {"name": "f", "parameters": p}} for p in (odd, other)]
    schema = tools.call_schema(twins)
    assert sorted(schema["$defs"]) == ["f.a/b", "f.a/b.2", "f.c~d e"]
    assert schema["anyOf"][0]["properties"]["arguments"]["properties"]["y"] == {"$ref": "#/$defs/f.c~0d%20e"}
    assert is_valid(call("f", {"x": 1, "y": "z"}), schema) and is_valid(call("f", {"x": "1"}), schema)
    assert not is_valid(call("f", {"x": 1.5}), schema)


def test_only_references_are_rewritten() -> None:
    data = {"$ref": "#/$defs/A"}  # inside const, enum and default: a value, not a reference
    schema = {
        "$defs": {"A": {"type": "object"}},
        "type": "object",
        "properties": {
            "$ref": {"const": data, "default": data, "enum": [data]},  # a property named "$ref"
            "remote": {"$ref": "https://example.com/schema.json#/$defs/A"},
            "anchored": {"$ref": "#an-anchor"},
            "missing": {"$ref": "#/$defs/Missing"},
        },
    }
    nested = Definitions().nest(schema, ["properties", "arguments"], "t")
    assert nested["properties"]["$ref"] == schema["properties"]["$ref"]  # type: ignore[index]
    assert nested["properties"]["remote"] == {"$ref": "https://example.com/schema.json#/$defs/A"}
    assert nested["properties"]["anchored"] == {"$ref": "#an-anchor"}
    # Still nothing there: the grammar library names the pointer in its 400.
    assert nested["properties"]["missing"] == {"$ref": "#/properties/arguments/$defs/Missing"}
    assert Definitions().nest(True, ["x"], "t") is True


# The shapes of the schemas these libraries send, made here with pydantic as they make them:
# instructor's `Iterable[Model]` is a model with a list of them under "tasks"; pydantic-ai's
# output tool ("final_result") takes the output model's own schema, optional fields as anyOf
# null; openai-agents makes one model of a function's arguments.
CLIENT_LIBRARY_TOOLS = {
    "instructor": (
        create_model("IterablePerson", tasks=(list[Person], ...)),
        "IterablePerson",
        {"tasks": [ALICE, ALICE]},
    ),
    "pydantic-ai": (
        create_model("Household", head=(Person, ...), pet=(Node | None, None)),
        "final_result",
        {"head": ALICE, "pet": TREE},
    ),
    "openai-agents": (
        create_model("ship_args", parcel=(Parcel, ...), sender=(Person, ...)),
        "ship",
        {"parcel": PARCEL_ARGS, "sender": ALICE},
    ),
}


@pytest.mark.parametrize("style", list(CLIENT_LIBRARY_TOOLS))
def test_client_library_schemas(style: str) -> None:
    model, name, arguments = CLIENT_LIBRARY_TOOLS[style]
    tool = {"type": "function", "function": {"name": name, "parameters": model.model_json_schema()}}
    assert "$defs" in parameters(tool)
    schema = tools.call_schema([tool, NODE])
    assert is_valid(call(name, arguments), schema)
    model.model_validate(arguments)
    assert all(resolve(schema, ref) is not None for ref in refs(schema))


# -- grammars -------------------------------------------------------------------------------------


def accepts(matcher: GrammarMatcher, tokenizer: Any, text: str) -> bool:
    """Whether `matcher` takes the whole of `text` and is then complete."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.accept(token) for token in ids) and matcher.is_terminated()


def generate(matcher: GrammarMatcher, tokenizer: Any, seed: int, max_tokens: int = 1500) -> str:
    """A text the grammar allows, each token drawn at random from those it allows next."""
    rng, ids = random.Random(seed), list[int]()
    while not matcher.is_terminated():
        assert len(ids) < max_tokens, tokenizer.decode(ids)
        token = rng.choice(allowed_ids(matcher).tolist())
        if token == tokenizer.eos_token_id:
            break
        assert matcher.accept(token)
        ids.append(token)
    text: str = tokenizer.decode(ids)
    return text


def hermes_text(c: dict[str, Any]) -> str:
    return tools.render_call(c["name"], c["arguments"])


def llama3_text(c: dict[str, Any]) -> str:
    return json.dumps({"name": c["name"], "parameters": c["arguments"]})


FORMATS: dict[str, tuple[Callable[..., StructuredOutputs], Callable[[dict[str, Any]], str]]] = {
    "hermes": (tools.call_grammar, hermes_text),
    "llama3": (llama3_tools.call_grammar, llama3_text),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_required_call_grammar_takes_valid_calls_only(
    compiler: GrammarCompiler, tokenizer: Any, fmt: str
) -> None:
    call_grammar, render = FORMATS[fmt]
    grammar = compiler.compile(call_grammar(TOOLS), param="tools")
    for valid in VALID_CALLS:
        assert accepts(grammar.matcher(), tokenizer, render(valid)), valid
    for invalid in INVALID_CALLS:
        assert not accepts(grammar.matcher(), tokenizer, render(invalid)), invalid


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_named_call_grammar(compiler: GrammarCompiler, tokenizer: Any, fmt: str) -> None:
    call_grammar, render = FORMATS[fmt]
    for valid in VALID_CALLS:
        grammar = compiler.compile(call_grammar(TOOLS, valid["name"]), param="tools")
        assert accepts(grammar.matcher(), tokenizer, render(valid)), valid
        other = VALID_CALLS[(VALID_CALLS.index(valid) + 1) % len(VALID_CALLS)]
        assert not accepts(grammar.matcher(), tokenizer, render(other))


MODELS: dict[str, type[BaseModel]] = {"Person": Person, "Node": Node, "Parcel": Parcel}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("name", [None, "Person", "Node"])
def test_generated_calls_are_valid(
    compiler: GrammarCompiler, tokenizer: Any, fmt: str, name: str | None
) -> None:
    grammar = compiler.compile(FORMATS[fmt][0](TOOLS, name), param="tools")
    by_name = {tool["function"]["name"]: parameters(tool) for tool in TOOLS}
    for seed in range(3):
        text = generate(grammar.matcher(), tokenizer, seed)
        if fmt == "hermes":
            assert text.startswith(tools.OPEN) and text.endswith(tools.CLOSE), text
            parsed = tools.parse_call(text[len(tools.OPEN) : -len(tools.CLOSE)])
        else:
            parsed = llama3_tools.parse_call(text, by_name, 0)
        assert parsed is not None, text
        assert name is None or parsed.name == name
        arguments = json.loads(parsed.arguments)
        jsonschema.validate(arguments, by_name[parsed.name])
        if parsed.name in MODELS:
            MODELS[parsed.name].model_validate(arguments)


def test_response_format_schema_is_not_nested(compiler: GrammarCompiler, tokenizer: Any) -> None:
    # response_format's schema is the whole output, so its references resolve as they are. The
    # schemas are the strict ones the openai SDK's `parse` sends (no additional properties).
    for model, instance in ((Person, ALICE), (Node, TREE)):
        spec = StructuredOutputs(json=parameters(function_tool(model)))
        grammar = compiler.compile(spec, param="response_format")
        assert accepts(grammar.matcher(), tokenizer, json.dumps(instance))
        model.model_validate_json(generate(grammar.matcher(), tokenizer, seed=0))
