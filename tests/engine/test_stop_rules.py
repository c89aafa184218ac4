"""The output processor's stop rules where not all of a choice's text is free: an output a grammar
constrains (all of it) and tool calls in free text (tool_choice "auto"). A stop string or stop
token never cuts those; around a call it does, as anywhere in free text.

The real output processor, tokenizer, detokenizer and grammar matcher, fed a scripted output one
token per step as the sampler hands tokens over: what the model would write is fixed, so each
rule is tested on the text it is about. No model is loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from yaie.engine.model_runner import RunnerOutput
from yaie.engine.output_processor import OutputProcessor
from yaie.engine.request import Request
from yaie.engine.scheduler import ScheduledSequence, SchedulerOutput
from yaie.engine.sequence import Sequence
from yaie.model.loader import bundled_model_path, load_tokenizer
from yaie.outputs import CompletionOutput
from yaie.sampling.sampler import SamplerOutput
from yaie.sampling_params import SamplingParams
from yaie.structured.backend import GrammarCompiler
from yaie.structured.spec import StructuredOutputs
from yaie.structured.tool_formats import HERMES, LLAMA3

# Each of these occurs inside JSON.
JSON_STOPS = ["}", ",", '"', ":", "{", "e", " "]
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
OBJECT = '{"a": "x, y} e:z"}'  # valid for SCHEMA, and holds every one of JSON_STOPS
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France"}}\n</tool_call>'
LLAMA3_CALL = '{"name": "get_weather", "parameters": {"city": "Paris, France"}}'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(bundled_model_path())


@pytest.fixture(scope="module")
def processor(tokenizer: Any) -> OutputProcessor:
    return OutputProcessor(tokenizer, [tokenizer.eos_token_id], max_model_len=8192)


@dataclass
class Run:
    output: CompletionOutput  # the choice's last output
    shown: list[str]  # the text a stream had shown after each step


def generate(
    processor: OutputProcessor, text: str, params: SamplingParams, compiler: GrammarCompiler | None = None
) -> Run:
    """The choice whose sampled tokens are `text`'s, one per step, until a stop rule ends it (or
    its tokens run out: max_tokens is their number)."""
    token_ids = processor.tokenizer(text, add_special_tokens=False).input_ids
    params.max_tokens = len(token_ids)
    prompt = processor.tokenizer("Hi").input_ids
    seq = Sequence("r-0", prompt, params, "r", 0)
    if params.structured_outputs is not None:
        assert compiler is not None
        seq.grammar = compiler.compile(params.structured_outputs).matcher()
    request = Request("r", None, prompt, params, choices=[processor.new_choice(seq)])
    shown, streamed = [], ""
    for token_id in token_ids:
        seq.num_computed_tokens = seq.num_tokens - 1  # the step computes its last token
        plan = SchedulerOutput([ScheduledSequence(seq, 1)])
        logits = RunnerOutput(torch.empty(1, len(processor.tokenizer)))
        [output], finished = processor.process({"r": request}, plan, logits, SamplerOutput([[token_id]]))
        [choice] = output.outputs
        streamed += choice.delta_text
        assert streamed == choice.text  # deltas add up to the text so far
        shown.append(streamed)
        if finished:
            return Run(choice, shown)
    raise AssertionError("the choice did not finish")


def test_no_stop_string_or_token_cuts_a_constrained_output(
    processor: OutputProcessor, tokenizer: Any
) -> None:
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    stop_token_ids = [tokenizer.convert_tokens_to_ids(token) for token in (",", "}")]
    params = SamplingParams(
        stop=JSON_STOPS, stop_token_ids=stop_token_ids, structured_outputs=StructuredOutputs(json=SCHEMA)
    )
    run = generate(processor, OBJECT, params, compiler)
    # The grammar ended it, complete: finish_reason "stop" with no stop string or token to name.
    assert (run.output.text, run.output.finish_reason, run.output.stop_reason) == (OBJECT, "stop", None)
    assert json.loads(run.output.text) == {"a": "x, y} e:z"}
    # Nothing a stop string could cut is held back: the stream shows each token as it comes.
    assert run.shown == [tokenizer.decode(ids) for ids in prefixes(tokenizer, OBJECT)]


def test_without_a_constraint_the_same_stop_string_cuts(processor: OutputProcessor) -> None:
    run = generate(processor, OBJECT, SamplingParams(stop=["}"]))
    assert (run.output.text, run.output.finish_reason, run.output.stop_reason) == ('{"a": "x, y', "stop", "}")


def prefixes(tokenizer: Any, text: str) -> list[list[int]]:
    token_ids = tokenizer(text, add_special_tokens=False).input_ids
    return [token_ids[: i + 1] for i in range(len(token_ids))]


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        # Inside the call the stop string is text of the call's; around it, it stops.
        (f"Let me check {CALL} then, more", ",", f"Let me check {CALL} then"),
        (f"Well, {CALL}", ",", "Well"),
        (f"{CALL}\n{CALL}", "France", f"{CALL}\n{CALL}"),  # only inside calls: never cut
        # A block whose body is no call is content (as the parser gives it out): it is cut.
        ("<tool_call>\nnot a call, sorry\n</tool_call> ok", ",", "<tool_call>\nnot a call"),
        # A stop string that begins like the tag cuts once the tag turns out not to be one.
        ("Use <tool_x> here", "<tool_x", "Use "),
    ],
)
def test_stop_strings_apply_around_hermes_tool_calls(
    processor: OutputProcessor, text: str, stop: str, expected: str
) -> None:
    params = SamplingParams(stop=[stop], tool_call_spans=HERMES.call_spans(["get_weather"]))
    run = generate(processor, text, params)
    assert run.output.text == expected
    cut = expected != text
    assert (run.output.finish_reason, run.output.stop_reason) == (("stop", stop) if cut else ("length", None))
    # A stream never showed text past the cut.
    assert all(expected.startswith(shown) for shown in run.shown)


def test_a_stop_token_inside_a_call_does_not_end_the_choice(
    processor: OutputProcessor, tokenizer: Any
) -> None:
    comma = tokenizer.convert_tokens_to_ids(",")
    text = f"Let me check {CALL} then, more"  # "," is a token of its own inside the call and after it
    params = SamplingParams(stop_token_ids=[comma], tool_call_spans=HERMES.call_spans(["get_weather"]))
    run = generate(processor, text, params)
    assert (run.output.text, run.output.finish_reason, run.output.stop_reason) == (
        f"Let me check {CALL} then",
        "stop",
        comma,
    )
    # The same tokens without tool calls to keep whole: the comma inside the call ends it.
    run = generate(processor, text, SamplingParams(stop_token_ids=[comma]))
    assert run.output.text == 'Let me check <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris'


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        (f"{LLAMA3_CALL}; {LLAMA3_CALL}", ",", f"{LLAMA3_CALL}; {LLAMA3_CALL}"),
        (f"{LLAMA3_CALL}; {LLAMA3_CALL}", ";", LLAMA3_CALL),  # the separator is free text
        # An object that is no call of the request's tools is content, as the parser decides.
        ('{"name": "other", "parameters": {"a": "b, c"}}', ",", '{"name": "other"'),
        ("Hello, world", ",", "Hello"),
    ],
)
def test_stop_strings_apply_around_llama3_tool_calls(
    processor: OutputProcessor, text: str, stop: str, expected: str
) -> None:
    params = SamplingParams(stop=[stop], tool_call_spans=LLAMA3.call_spans(["get_weather"]))
    run = generate(processor, text, params)
    assert run.output.text == expected
    assert run.output.finish_reason == ("stop" if expected != text else "length")
    assert all(expected.startswith(shown) for shown in run.shown)


def test_every_stop_string_still_applies_to_free_text(processor: OutputProcessor) -> None:
    """With tool calls to keep whole, free text is searched as it always is: stop strings that
    straddle tokens, the first of several, include_stop_str_in_output."""
    spans = HERMES.call_spans(["get_weather"])
    text = "The weather in Paris is mild today"
    for stops, include, expected in (
        (["ris i", "mild"], False, "The weather in Pa"),
        (["mild", "ris i"], True, "The weather in Paris i"),
    ):
        params = SamplingParams(stop=stops, include_stop_str_in_output=include, tool_call_spans=spans)
        assert generate(processor, text, params).output.text == expected
