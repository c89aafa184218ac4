"""Ollama's API through the official `ollama` client against the shared server: chat and generate,
streamed (NDJSON) and not, options mapped onto our sampling, format json and a schema, tools
with object arguments, raw prompts, the model listing endpoints, and errors in Ollama's shape."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import ollama
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours."}]
GREEDY = {"temperature": 0, "num_predict": 12}
CHAT = {"model": MODEL, "messages": QUESTION}
GENERATE = {"model": MODEL, "prompt": "x"}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def oclient(server: Server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def test_chat_streamed_and_whole_agree(oclient: ollama.Client) -> None:
    whole = oclient.chat(model=MODEL, messages=QUESTION, options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == GREEDY["num_predict"]
    assert whole.message.role == "assistant" and whole.message.content
    assert whole.model == MODEL and whole.created_at and whole.created_at.endswith("Z")
    assert whole.prompt_eval_count and whole.prompt_eval_count > 5
    assert whole.total_duration and whole.eval_duration and whole.prompt_eval_duration
    assert whole.total_duration >= whole.eval_duration + whole.prompt_eval_duration
    assert whole.load_duration == 0

    chunks = list(oclient.chat(model=f"{MODEL}:latest", messages=QUESTION, options=GREEDY, stream=True))
    assert [chunk.done for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert len(chunks) > 2  # token by token, not one blob
    assert "".join(chunk.message.content or "" for chunk in chunks) == whole.message.content
    final = chunks[-1]
    assert final.done_reason == "length" and final.eval_count == whole.eval_count
    assert final.prompt_eval_count == whole.prompt_eval_count and final.model == f"{MODEL}:latest"


def test_stream_is_the_default_and_is_ndjson(server: Server) -> None:
    body = {"model": MODEL, "prompt": "Hello", "options": GREEDY}
    with server.http() as http, http.stream("POST", "/api/generate", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in response.iter_lines()]
    assert len(lines) > 2 and lines[-1]["done"] is True and lines[-1]["done_reason"] in ("stop", "length")
    assert all(line["done"] is False for line in lines[:-1])


def test_generate_streamed_and_whole_agree(oclient: ollama.Client) -> None:
    whole = oclient.generate(model=MODEL, prompt="Write a haiku about the sea.", options=GREEDY)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == GREEDY["num_predict"]
    assert (
        whole.response and whole.context and len(whole.context) == whole.prompt_eval_count + whole.eval_count
    )
    chunks = list(
        oclient.generate(model=MODEL, prompt="Write a haiku about the sea.", options=GREEDY, stream=True)
    )
    assert "".join(chunk.response or "" for chunk in chunks) == whole.response
    assert chunks[-1].context == whole.context


def test_system_goes_through_the_chat_template(oclient: ollama.Client) -> None:
    system, prompt = "You are a pirate.", "Say hi."
    generated = oclient.generate(model=MODEL, prompt=prompt, system=system, options=GREEDY)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    chatted = oclient.chat(model=MODEL, messages=messages, options=GREEDY)
    assert generated.response == chatted.message.content
    assert generated.prompt_eval_count == chatted.prompt_eval_count


def test_raw_generate_is_the_prompt_as_is(oclient: ollama.Client, client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    raw = oclient.generate(model=MODEL, prompt=prompt, raw=True, options=GREEDY)
    completion = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert raw.response == completion.choices[0].text
    assert completion.usage is not None and raw.prompt_eval_count == completion.usage.prompt_tokens
    templated = oclient.generate(model=MODEL, prompt=prompt, options=GREEDY)
    assert templated.prompt_eval_count and raw.prompt_eval_count
    assert templated.prompt_eval_count > raw.prompt_eval_count  # the chat template's turns around it


def test_template_and_context(oclient: ollama.Client) -> None:
    template = "{{ if .System }}{{ .System }}\n{{ end }}Q: {{ .Prompt }}\nA:{{ .Response }}"
    first = oclient.generate(model=MODEL, prompt="What is 2+2?", template=template, options=GREEDY)
    raw = oclient.generate(model=MODEL, prompt="Q: What is 2+2?\nA:", raw=True, options=GREEDY)
    assert first.response == raw.response
    assert first.context is not None
    more = oclient.generate(model=MODEL, prompt=" And 3+3?", raw=True, context=first.context, options=GREEDY)
    assert more.prompt_eval_count and more.prompt_eval_count > len(first.context)


def test_temperature_zero_is_deterministic_and_seed_reproduces(oclient: ollama.Client) -> None:
    greedy = [oclient.chat(model=MODEL, messages=QUESTION, options=GREEDY).message.content for _ in range(2)]
    assert greedy[0] == greedy[1]
    sampled = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "num_predict": 16}
    seeded = [oclient.chat(model=MODEL, messages=QUESTION, options=sampled).message.content for _ in range(2)]
    assert seeded[0] == seeded[1]
    others = {
        oclient.chat(model=MODEL, messages=QUESTION, options={**sampled, "seed": seed}).message.content
        for seed in (1, 2, 3)
    }
    assert len(others | {seeded[0]}) > 1  # the seed is what makes them equal


def test_options_we_do_not_use_are_accepted(oclient: ollama.Client) -> None:
    options = {**GREEDY, "num_ctx": 8192, "num_thread": 4, "mirostat": 0, "num_gpu": 1, "stop": ["\n\n\n"]}
    response = oclient.chat(model=MODEL, messages=QUESTION, options=options, keep_alive="5m")
    assert response.done and response.message.content


def test_num_predict_unlimited_stops_at_eos(oclient: ollama.Client) -> None:
    response = oclient.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        options={"temperature": 0, "num_predict": -1},
    )
    assert response.done_reason == "stop" and response.eval_count and response.eval_count > 0


@pytest.mark.parametrize("stream", [False, True])
def test_format_schema_gives_valid_json(oclient: ollama.Client, stream: bool) -> None:
    messages = [{"role": "user", "content": "Invent a person: their name and age, as JSON."}]
    options = {"temperature": 0, "num_predict": 100}
    if stream:
        chunks = list(
            oclient.chat(model=MODEL, messages=messages, format=PERSON, options=options, stream=True)
        )
        content, reason = "".join(c.message.content or "" for c in chunks), chunks[-1].done_reason
    else:
        response = oclient.chat(model=MODEL, messages=messages, format=PERSON, options=options)
        content, reason = response.message.content or "", response.done_reason
    assert reason == "stop", content
    jsonschema.validate(json.loads(content), PERSON)


def test_format_json_gives_a_json_object(oclient: ollama.Client) -> None:
    prompt = 'Reply with the JSON object {"ok": true}.'
    response = oclient.generate(
        model=MODEL, prompt=prompt, format="json", options={"temperature": 0, "num_predict": 60}
    )
    assert response.done_reason == "stop", response.response
    assert isinstance(json.loads(response.response or ""), dict)


def get_weather(city: str) -> str:
    """Get the current weather in a city.

    Args:
      city: The city's name

    Returns:
      str: The weather
    """
    return f"It is sunny in {city}."


WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


def test_tools_are_offered_to_the_model(oclient: ollama.Client) -> None:
    # Left to choose (Ollama's only way), the small model answers in words; the tools still
    # reach its prompt through the chat template.
    options = {"temperature": 0, "num_predict": 8}
    offered = oclient.chat(model=MODEL, messages=WEATHER_QUESTION, tools=[get_weather], options=options)
    plain = oclient.chat(model=MODEL, messages=WEATHER_QUESTION, options=options)
    assert offered.prompt_eval_count and plain.prompt_eval_count
    assert offered.prompt_eval_count > plain.prompt_eval_count


def chat_with_required_call(server: Server, stream: bool) -> list[ollama.ChatResponse]:
    """A chat whose model must call (yaie's tool_choice extension, which the ollama client cannot
    send), read as the ollama client reads responses."""
    body = {
        "model": MODEL, "messages": WEATHER_QUESTION, "tools": [WEATHER_TOOL], "tool_choice": "required",
        "stream": stream, "options": {"temperature": 0, "num_predict": 60},
    }  # fmt: skip
    with server.http() as http:
        response = http.post("/api/chat", json=body)
    assert response.status_code == 200, response.text
    return [ollama.ChatResponse(**json.loads(line)) for line in response.text.splitlines()]


@pytest.mark.parametrize("stream", [False, True])
def test_tools_give_calls_with_object_arguments(server: Server, stream: bool) -> None:
    responses = chat_with_required_call(server, stream)
    assert len(responses) > 1 if stream else len(responses) == 1
    calls = [call for response in responses for call in response.message.tool_calls or []]
    assert responses[-1].done and responses[-1].done_reason == "stop"
    [call] = calls
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, dict) and isinstance(call.function.arguments["city"], str)


def test_a_tool_loop_continues(oclient: ollama.Client, server: Server) -> None:
    [first] = chat_with_required_call(server, stream=False)
    assert first.message.tool_calls
    call = first.message.tool_calls[0]
    messages: list[Any] = [
        *WEATHER_QUESTION,
        first.message,
        {"role": "tool", "content": get_weather(**call.function.arguments), "tool_name": call.function.name},
    ]
    options = {"temperature": 0, "num_predict": 30}
    answer = oclient.chat(model=MODEL, messages=messages, tools=[get_weather], options=options)
    assert answer.done and answer.prompt_eval_count and first.prompt_eval_count
    assert answer.prompt_eval_count > first.prompt_eval_count  # the call and its result are in the prompt


def test_tags_show_ps_version(oclient: ollama.Client, server: Server) -> None:
    [listed] = oclient.list().models
    assert listed.model == f"{MODEL}:latest" and listed.size and listed.size > 0
    assert listed.digest and listed.digest.startswith("sha256:") and listed.modified_at is not None
    assert listed.details and listed.details.format in ("gguf", "safetensors") and listed.details.family
    shown = oclient.show(MODEL)
    assert shown.details and shown.details.family == listed.details.family
    assert shown.capabilities and "completion" in shown.capabilities
    assert shown.modelinfo and any(key.endswith(".context_length") for key in shown.modelinfo)
    assert shown.template  # the chat template
    [running] = oclient.ps().models
    assert running.model == listed.model and running.context_length and running.context_length > 0
    with server.http() as http:
        version = http.get("/api/version")
        raw_tags = http.get("/api/tags").json()
    assert version.status_code == 200 and version.json()["version"]
    assert raw_tags["models"][0]["name"] == f"{MODEL}:latest"


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.chat(model="nope", messages=QUESTION),
        lambda c: list(c.chat(model="nope", messages=QUESTION, stream=True)),
        lambda c: c.generate(model="nope:latest", prompt="hi"),
        lambda c: c.show("nope"),
    ],
    ids=["chat", "chat-stream", "generate", "show"],
)
def test_unknown_model_is_404(oclient: ollama.Client, call: Any) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        call(oclient)
    assert info.value.status_code == 404
    assert isinstance(info.value.error, str) and "nope" in info.value.error


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"temperature": -1}, "options.temperature"),
        ({"temperature": "hot"}, "options.temperature"),
        ({"num_predict": 0}, "options.num_predict"),
        ({"repeat_penalty": 0}, "options.repeat_penalty"),
        ({"top_k": 1.5}, "options.top_k"),
    ],
)
def test_bad_options_are_400(oclient: ollama.Client, options: dict[str, Any], field: str) -> None:
    for stream in (False, True):
        with pytest.raises(ollama.ResponseError) as info:
            list(oclient.chat(model=MODEL, messages=QUESTION, options=options, stream=True)) if stream else (
                oclient.chat(model=MODEL, messages=QUESTION, options=options)
            )
        assert info.value.status_code == 400 and field in info.value.error


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/chat", b'{"model": "smol", "messages": [', "JSON"),
        ("/api/chat", b'["smol"]', "JSON object"),
        ("/api/chat", {"messages": QUESTION}, "model"),
        ("/api/chat", {**CHAT, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ("/api/chat", {**CHAT, "messages": "hi"}, "messages"),
        ("/api/chat", {**CHAT, "format": "xml"}, "format"),
        ("/api/chat", {**CHAT, "format": {"type": "nonsense"}}, "format"),
        ("/api/chat", {**CHAT, "tools": [{"type": "function"}]}, "tools[0].function"),
        ("/api/chat", {**CHAT, "messages": [{"role": "user", "content": "x", "images": ["aGk="]}]}, "images"),
        ("/api/chat", {**CHAT, "think": True}, "think"),
        ("/api/generate", {**GENERATE, "suffix": "y"}, "suffix"),
        ("/api/generate", {**GENERATE, "raw": True, "system": "s"}, "system"),
        ("/api/generate", {**GENERATE, "context": [-1]}, "context"),
        ("/api/generate", {**GENERATE, "template": "{{ range .Messages }}{{ end }}"}, "template"),
        ("/api/generate", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/api/show", {}, "model"),
    ],
)  # fmt: skip
def test_bad_input_is_400_in_ollamas_shape(server: Server, path: str, body: Any, field: str) -> None:
    with server.http() as http:
        response = http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert list(error) == ["error"] and isinstance(error["error"], str) and field in error["error"]


def test_nothing_to_generate_loads_the_model(oclient: ollama.Client) -> None:
    assert oclient.generate(model=MODEL, prompt="").done_reason == "load"
    assert oclient.chat(model=MODEL, messages=[]).done_reason == "load"


def test_a_prompt_too_long_for_the_context_is_400(oclient: ollama.Client, server: Server) -> None:
    with server.http() as http:
        max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(ollama.ResponseError) as info:
        oclient.generate(
            model=MODEL, prompt="hello " * (max_model_len + 10), raw=True, options={"num_predict": 1}
        )
    assert info.value.status_code == 400
