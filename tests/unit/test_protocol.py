"""Request validation and mapping onto SamplingParams, and response formatting: no model needed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from yaie.errors import InvalidRequestError
from yaie.outputs import CompletionOutput, RequestOutput, TokenLogprob
from yaie.server.chat_completions import ChatCompletion
from yaie.server.completions import Completion
from yaie.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    TokenizeRequest,
    Usage,
    chat_logprobs,
    completion_logprobs,
    describe_validation_error,
)
from yaie.structured.tool_formats import HERMES

HELLO = [{"role": "user", "content": "Hello"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HELLO, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hello", **fields})


def validation_error(
    model: type[ChatCompletionRequest | CompletionRequest], body: Any
) -> InvalidRequestError:
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    return describe_validation_error(raised.value.errors())


def refusal(request: ChatCompletionRequest | CompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        request.to_sampling_params()
    return raised.value


# -- parsing ----------------------------------------------------------------------------------


def test_unknown_fields_are_ignored() -> None:
    request = chat(frobnicate=True, metadata={"a": 1}, parallel_tool_calls=False)
    assert not hasattr(request, "frobnicate")


def test_numbers_are_not_coerced_from_strings_or_bools() -> None:
    assert validation_error(
        ChatCompletionRequest, {"model": "m", "messages": HELLO, "max_tokens": "5"}
    ).param == ("max_tokens")
    assert validation_error(ChatCompletionRequest, {"model": "m", "messages": HELLO, "n": True}).param == "n"
    assert validation_error(ChatCompletionRequest, {"model": "m", "messages": HELLO, "n": 2.0}).param == "n"
    assert chat(temperature=1).temperature == 1.0  # an integer is a fine number


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": 5, "messages": HELLO}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": "Hello"}, "messages"),
        ({"model": "m", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
        ),
        ({"model": "m", "messages": HELLO, "stop": [1]}, "stop[0]"),
        ({"model": "m", "messages": HELLO, "logit_bias": {"5": "high"}}, "logit_bias"),
        (
            {"model": "m", "messages": HELLO, "stream_options": {"include_usage": "yes"}},
            "stream_options.include_usage",
        ),
    ],
)
def test_validation_errors_name_the_field(body: dict[str, Any], param: str) -> None:
    error = validation_error(ChatCompletionRequest, body)
    assert error.param == param
    assert error.message.startswith(f"{param}: ")


def test_model_may_be_left_out() -> None:
    """The server serves its one model to a request without "model", as vLLM and llama.cpp."""
    assert ChatCompletionRequest.model_validate({"messages": HELLO}).model is None
    assert CompletionRequest.model_validate({"prompt": "Hi"}).model is None


def test_missing_field_message() -> None:
    assert validation_error(CompletionRequest, {"model": "m"}).message == "prompt: missing required parameter"


def test_union_errors_name_the_deepest_branch() -> None:
    assert validation_error(CompletionRequest, {"model": "m", "prompt": ["a", 1]}).param == "prompt[1]"
    assert validation_error(CompletionRequest, {"model": "m", "prompt": 5}).param == "prompt"


LONE = "\ud800"  # what the JSON escape \\ud800 decodes to: not encodable as UTF-8


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"model": "m", "prompt": f"Hi {LONE}"}, "prompt"),
        (CompletionRequest, {"model": "m", "prompt": ["ok", LONE]}, "prompt[1]"),
        (CompletionRequest, {"model": "m", "prompt": "Hi", "stop": LONE}, "stop"),
        (CompletionRequest, {"model": "m", "prompt": "Hi", "stop": ["ok", "\udfff"]}, "stop[1]"),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": LONE}]},
            "messages[0].content",
        ),
        (
            ChatCompletionRequest,
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
            "messages[0].content[0].text",
        ),
        (ChatCompletionRequest, {"model": LONE, "messages": HELLO}, "model"),
        (TokenizeRequest, {"prompt": LONE}, "prompt"),
    ],
)
def test_lone_surrogates_are_refused_by_field(model: type[BaseModel], body: Any, param: str) -> None:
    with pytest.raises(ValidationError) as raised:
        model.model_validate(body)
    error = describe_validation_error(raised.value.errors())
    assert error.param == param
    assert error.message.startswith(f"{param}: invalid Unicode: a lone surrogate at position ")


def test_valid_non_ascii_text_is_kept() -> None:
    text = "naïve 日本語 🙂"
    assert completion(prompt=text, stop=[text]).prompt == text


def test_fastapi_errors() -> None:
    """FastAPI reports body errors with a leading "body", and JSON errors by position."""
    error = describe_validation_error(
        [{"type": "int_type", "loc": ("body", "n"), "msg": "bad", "input": "x"}]
    )
    assert (error.param, error.message) == ("n", "n: bad")
    json_error = describe_validation_error(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 12),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": "oops"},
            }
        ]
    )
    assert json_error.param is None and "oops" in json_error.message
    not_object = describe_validation_error(
        [{"type": "model_attributes_type", "loc": ("body",), "msg": "x", "input": 1}]
    )
    assert not_object.param is None and "JSON object" in not_object.message


def test_chat_messages_for_the_template() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        ]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
    ]


@pytest.mark.parametrize(
    ("prompt", "prompts"),
    [
        ("Hi", ["Hi"]),
        (["Hi", "Yo"], ["Hi", "Yo"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: Any, prompts: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("prompt", ["", []])
def test_empty_prompt_is_refused(prompt: Any) -> None:
    with pytest.raises(InvalidRequestError) as raised:
        completion(prompt=prompt).prompts()
    assert raised.value.param == "prompt"


# -- mapping ----------------------------------------------------------------------------------


def test_defaults_follow_openai() -> None:
    params = chat().to_sampling_params()
    assert params.temperature == 1.0 and params.top_p == 1.0 and params.n == 1
    assert params.max_tokens is None  # the rest of the context
    assert params.logprobs is None


def test_explicit_nulls_mean_defaults() -> None:
    params = chat(temperature=None, top_p=None, stop=None, seed=None, logit_bias=None).to_sampling_params()
    assert params.temperature == 1.0 and params.stop == [] and params.seed is None


MODEL_DEFAULTS = {"temperature": 0.2, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1}


def test_model_defaults_fill_the_fields_a_request_leaves_out() -> None:
    params = chat().to_sampling_params(defaults=MODEL_DEFAULTS)
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, 20)
    assert (params.min_p, params.repetition_penalty) == (0.05, 1.1)
    request = chat(temperature=0.7, top_k=-1, repetition_penalty=1.0)
    given = request.to_sampling_params(defaults=MODEL_DEFAULTS)
    assert (given.temperature, given.top_k, given.repetition_penalty) == (0.7, -1, 1.0)  # the request's
    assert (given.top_p, given.min_p) == (0.9, 0.05)  # the model's
    null = chat(temperature=None).to_sampling_params(defaults=MODEL_DEFAULTS)
    assert null.temperature == 0.2  # null means left out
    text = completion(temperature=0).to_sampling_params(defaults=MODEL_DEFAULTS)
    assert text.greedy and text.top_p == 0.9


def test_every_sampling_field_is_mapped() -> None:
    params = chat(
        n=2,
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=3,
        stop="END",
        stop_token_ids=[7],
        min_tokens=2,
        ignore_eos=True,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        logit_bias={"12": -100, "13": 5.5},
        logprobs=True,
        top_logprobs=4,
        user="someone",
    ).to_sampling_params()
    assert (params.n, params.max_tokens, params.temperature, params.top_p, params.top_k) == (
        2,
        7,
        0.5,
        0.9,
        40,
    )
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.05, 0.5, -0.5)
    assert (params.repetition_penalty, params.seed, params.stop, params.stop_token_ids) == (
        1.1,
        3,
        ["END"],
        [7],
    )
    assert (params.min_tokens, params.ignore_eos, params.skip_special_tokens) == (2, True, False)
    assert params.include_stop_str_in_output
    assert params.logit_bias == {12: -100.0, 13: 5.5}
    assert params.logprobs == 4


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5, max_completion_tokens=9).to_sampling_params().max_tokens == 9


def test_chat_logprobs_without_top_logprobs() -> None:
    assert chat(logprobs=True).to_sampling_params().logprobs == 0
    assert chat(logprobs=False).to_sampling_params().logprobs is None


def test_echo_with_logprobs_asks_for_prompt_logprobs() -> None:
    assert completion(echo=True, logprobs=2).to_sampling_params().prompt_logprobs == 2
    assert completion(echo=True).to_sampling_params().prompt_logprobs is None
    assert completion(logprobs=2).to_sampling_params().prompt_logprobs is None


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (chat(temperature=-1), "temperature"),
        (chat(top_p=0), "top_p"),
        (chat(top_k=-5), "top_k"),
        (chat(stop=[f"s{i}" for i in range(17)]), "stop"),
        (chat(logprobs=True, top_logprobs=21), "top_logprobs"),  # SamplingParams calls it logprobs
        (chat(top_logprobs=2), "top_logprobs"),
        (chat(logit_bias={"x": 1}), "logit_bias"),
        (chat(logit_bias={"-1": 1}), "logit_bias"),
        (chat(stream_options={"include_usage": True}), "stream_options"),
        # Content may be left out by an assistant turn that made calls, so this is checked here.
        (chat(messages=[HELLO[0], {"role": "user"}]), "messages[1].content"),
        (chat(tool_choice="required"), "tool_choice"),  # no tools to call
        (chat(response_format={"type": "json_schema"}), "response_format"),
        (chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "response_format"),
        (chat(structured_outputs={"regex": "a", "choice": ["a"]}), "structured_outputs"),
        (completion(suffix="x"), "suffix"),
        (completion(best_of=2), "best_of"),
        (completion(logprobs=21), "logprobs"),
    ],
)
def test_refusals_name_the_request_field(
    request_: ChatCompletionRequest | CompletionRequest, param: str
) -> None:
    error = refusal(request_)
    assert error.param == param
    assert error.message.startswith(f"{param}: ")


def test_accepted_no_ops() -> None:
    chat(tools=[], tool_choice="none", response_format={"type": "text"}).to_sampling_params()
    completion(best_of=3, n=3).to_sampling_params()


def test_logit_bias_keys_are_parsed_not_checked_against_the_vocabulary() -> None:
    # The engine, which knows the vocabulary, refuses ids beyond it (tests/e2e/test_bad_inputs.py).
    params = chat(logit_bias={"99999999": 1, "0": -1}).to_sampling_params()
    assert params.logit_bias == {99999999: 1.0, 0: -1.0}


def test_engine_errors_are_renamed_to_the_request_field() -> None:
    engine_error = InvalidRequestError("max_tokens=99 plus the prompt's 5 tokens exceeds ...", "max_tokens")
    renamed = chat(max_completion_tokens=99).translate_error(engine_error)
    assert renamed.param == "max_completion_tokens"
    assert renamed.message.startswith("max_completion_tokens=99")
    assert chat(max_tokens=99).translate_error(engine_error) is engine_error
    prompt_error = InvalidRequestError("the prompt is empty", "prompt")
    assert chat().translate_error(prompt_error) is prompt_error


SAMPLING_FIELDS = {
    "n": st.integers(-2, 200),
    "temperature": st.floats(-3, 3),
    "top_p": st.floats(-1, 2),
    "top_k": st.integers(-3, 100),
    "min_p": st.floats(-1, 2),
    "presence_penalty": st.floats(-3, 3),
    "frequency_penalty": st.floats(-3, 3),
    "repetition_penalty": st.floats(-1, 3),
    "max_tokens": st.integers(-2, 100),
    "min_tokens": st.integers(-2, 100),
    "seed": st.integers(-2, 2**64),
    "top_logprobs": st.integers(-2, 25),
    "logprobs": st.booleans(),
    "stop": st.lists(st.text(max_size=3), max_size=20),
    "logit_bias": st.dictionaries(
        st.sampled_from(["0", "5", "-1", "x", "999", "1000"]), st.floats(-200, 200)
    ),
}


@given(st.fixed_dictionaries({}, optional=SAMPLING_FIELDS))
def test_any_sampling_fields_are_accepted_or_refused_by_name(fields: dict[str, Any]) -> None:
    """Whatever the values, the answer is SamplingParams or a 400 naming a field that was sent."""
    try:
        request = chat(**fields)
        request.to_sampling_params()
    except ValidationError as exc:
        param = describe_validation_error(exc.errors()).param
        assert param is not None and param.split("[")[0] in fields
    except InvalidRequestError as exc:
        assert exc.param in fields


# -- responses --------------------------------------------------------------------------------


def decode(token_id: int) -> str:
    return {1: "Hel", 2: "lo", 3: " wé", 4: "!"}.get(token_id, f"<{token_id}>")


def test_chat_logprobs_format() -> None:
    logprobs = chat_logprobs([TokenLogprob(3, -0.5, [(3, -0.5), (4, -1.5)])], decode)
    assert logprobs.model_dump() == {
        "content": [
            {
                "token": " wé",
                "logprob": -0.5,
                "bytes": [32, 119, 195, 169],
                "top_logprobs": [
                    {"token": " wé", "logprob": -0.5, "bytes": [32, 119, 195, 169]},
                    {"token": "!", "logprob": -1.5, "bytes": [33]},
                ],
            }
        ]
    }


def test_completion_logprobs_format() -> None:
    tokens = [
        (1, None),
        (2, TokenLogprob(2, -0.25, [(2, -0.25)])),
        (4, TokenLogprob(4, -2.0, [(1, -1.0), (4, -2.0)])),
    ]
    logprobs = completion_logprobs(tokens, decode, text_offset=10)
    assert logprobs.model_dump() == {
        "tokens": ["Hel", "lo", "!"],
        "token_logprobs": [None, -0.25, -2.0],
        "top_logprobs": [None, {"lo": -0.25}, {"Hel": -1.0, "!": -2.0}],
        "text_offset": [10, 13, 15],
    }


def test_impossible_tokens_get_a_finite_logprob() -> None:
    """JSON cannot say -inf; like vLLM, we say -9999."""
    chat = chat_logprobs([TokenLogprob(4, float("-inf"), [(4, float("-inf"))])], decode)
    assert chat.content[0].logprob == chat.content[0].top_logprobs[0].logprob == -9999.0
    legacy = completion_logprobs([(4, TokenLogprob(4, float("-inf"), [(4, float("nan"))]))], decode, 0)
    assert legacy.token_logprobs == [-9999.0] and legacy.top_logprobs == [{"!": -9999.0}]


def test_usage_totals() -> None:
    usage = Usage.of(prompt_tokens=7, completion_tokens=5, cached_tokens=4)
    assert usage.model_dump() == {
        "prompt_tokens": 7,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


# -- whole responses from the finished outputs --------------------------------------------

USAGE = Usage.of(prompt_tokens=3, completion_tokens=4, cached_tokens=0)


def finished(choices: list[CompletionOutput], prompt_logprobs: Any = None) -> RequestOutput:
    return RequestOutput("r", None, [1, 2], choices, finished=True, prompt_logprobs=prompt_logprobs)


def chat_response(body: ChatCompletionRequest, final: RequestOutput) -> ChatCompletionResponse:
    return ChatCompletion("chatcmpl-1", "m", body, HERMES, decode).response([final], USAGE)


def test_chat_response_from_the_finished_output() -> None:
    logprob = {token_id: TokenLogprob(token_id, -0.5 * token_id) for token_id in (1, 2, 4)}
    final = finished(
        [  # in any order: the response lists them by index
            CompletionOutput(1, "!", [4], "length", logprobs=[logprob[4]]),
            CompletionOutput(0, "Hello", [1, 2], "stop", logprobs=[logprob[1], logprob[2]]),
        ]
    )
    response = chat_response(chat(n=2, logprobs=True), final)
    assert (response.id, response.model, response.usage) == ("chatcmpl-1", "m", USAGE)
    assert [choice.index for choice in response.choices] == [0, 1]
    first, second = response.choices
    assert (first.message.content, first.message.tool_calls, first.finish_reason) == ("Hello", None, "stop")
    assert first.logprobs == chat_logprobs([logprob[1], logprob[2]], decode)
    assert (second.message.content, second.finish_reason) == ("!", "length")
    assert second.logprobs == chat_logprobs([logprob[4]], decode)

    [plain] = chat_response(chat(), finished([CompletionOutput(0, "Hi", [1], "stop")])).choices
    assert (plain.message.content, plain.logprobs) == ("Hi", None)


def test_chat_response_splits_tool_calls_out_of_the_text() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    text = (
        '\n<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
        '\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    [choice] = chat_response(chat(tools=[tool]), finished([CompletionOutput(0, text, [1], "stop")])).choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None  # calls alone
    assert choice.message.tool_calls is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("f", {"a": 1}),
        ("f", {}),
    ]
    # Without tools in the request, the same text is content.
    [choice] = chat_response(chat(), finished([CompletionOutput(0, text, [1], "stop")])).choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (text, None, "stop")


def test_chat_response_splits_the_reasoning_off_before_the_tool_calls() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    # A call written while thinking is part of the thought, not a call.
    text = f"I could write {call} here.\n</think>\n\n{call}"
    output = finished([CompletionOutput(0, text, [1], "stop")])
    body = chat(tools=[tool])
    completion = ChatCompletion("chatcmpl-1", "m", body, HERMES, decode, starts_in_reasoning=True)
    [choice] = completion.response([output], USAGE).choices
    assert choice.message.reasoning_content == f"I could write {call} here."
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls or []] == ["f"]
    # Without a reasoning parser (None), the same text is left whole.
    [choice] = chat_response(chat(), output).choices
    assert (choice.message.content, choice.message.reasoning_content) == (text, None)


def test_completion_response_from_the_finished_outputs() -> None:
    """Each prompt's choices in order, prompt * n + index; with echo and logprobs the prompt's
    tokens come first and the text offsets run through the whole text."""
    first, last = TokenLogprob(2, -0.25, [(2, -0.25)]), TokenLogprob(4, -2.0, [])
    outputs = [
        finished([CompletionOutput(0, "!", [4], "length", logprobs=[last])], [None, first]),
        finished([CompletionOutput(0, "lo", [2], "stop", logprobs=[first])], [None, first]),
    ]

    async def decode_prompt(token_ids: list[int]) -> str:
        return "".join(decode(token_id) for token_id in token_ids)

    body = completion(prompt=[[1, 2], [1, 2]], echo=True, logprobs=0)
    response = asyncio.run(
        Completion("cmpl-1", "m", body, body.prompts(), decode_prompt, decode).response(outputs, USAGE)
    )
    assert (response.id, response.model, response.usage) == ("cmpl-1", "m", USAGE)
    one, two = response.choices
    assert (one.index, one.text, one.finish_reason) == (0, "Hello!", "length")
    assert one.logprobs == completion_logprobs([(1, None), (2, first), (4, last)], decode, 0)
    assert (two.index, two.text, two.finish_reason) == (1, "Hellolo", "stop")
    assert two.logprobs == completion_logprobs([(1, None), (2, first), (2, first)], decode, 0)

    plain = completion(prompt="Hel")
    [choice] = asyncio.run(
        Completion("cmpl-2", "m", plain, plain.prompts(), decode_prompt, decode).response(
            [finished([CompletionOutput(0, "lo", [2], "stop")])], USAGE
        )
    ).choices
    assert (choice.text, choice.logprobs) == ("lo", None)
