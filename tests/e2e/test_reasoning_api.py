"""The reasoning split (`yaie serve --reasoning-parser`) through each chat API's official client
(openai, anthropic, ollama), streamed and whole, against real servers of a tiny random model
whose chat template thinks as Qwen3's does: it opens `<think>` for the answer, or writes an empty
`<think></think>` itself when `enable_thinking` is false.

What the model writes is known without trusting the server's split: the same prompt's tokens
(from /tokenize, with the same template variables) through /v1/completions greedily give the
raw text, which the chat APIs must return split. A random model writes no tags on its own, so
the output that holds them is steered with a regex constraint; the tags then arrive in pieces,
several tokens each in this byte-level tokenizer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import ollama
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.e2e_helpers import MODEL, Server, start_server
from tests.model.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

# Qwen3's template, cut down to what matters here: how the answer's start is written.
THINKING_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 40}  # room for both tags, a byte a token
NO_EOS = {"ignore_eos": True}  # a random model may end at once; every test wants text
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TAGGED = r"<think>[a-z]{2,6}</think>[a-z]{2,6}"  # an output that thinks, then answers
STEERED = {"structured_outputs": {"regex": TAGGED}, **NO_EOS}


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("thinker")
    make_tiny_model("llama", path, seed=0)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2048}))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(path)
    return str(path)


def _serve(tmp_path_factory: pytest.TempPathFactory, model: str, parser: str) -> Iterator[Server]:
    server = start_server(tmp_path_factory.mktemp(parser), model, "--reasoning-parser", parser)
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory, thinker: str) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, thinker, "qwen3")


@pytest.fixture(scope="module")
def r1(tmp_path_factory: pytest.TempPathFactory, thinker: str) -> Iterator[Server]:
    yield from _serve(tmp_path_factory, thinker, "deepseek_r1")


def raw_text(
    server: Server, extra: dict[str, Any] | None = None, ignore_eos: bool = True, **kwargs: Any
) -> str:
    """What the model writes for QUESTION (rendered with `kwargs`' template variables), unsplit."""
    with server.http() as http:
        tokens = http.post("/tokenize", json={"messages": QUESTION, **kwargs}).json()["tokens"]
    completion = server.client().completions.create(
        model=MODEL, prompt=tokens, **GREEDY, extra_body={"ignore_eos": ignore_eos, **(extra or {})}
    )
    return completion.choices[0].text


def chat(server: Server, extra: dict[str, Any]) -> tuple[Any, tuple[str, str, list[dict[str, Any]]]]:
    """The whole answer's message, and the stream's (reasoning, content, deltas)."""
    client = server.client()
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, **GREEDY, extra_body=extra)  # type: ignore[arg-type]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        **GREEDY,
        extra_body=extra,
        stream=True,  # type: ignore[arg-type]
    )
    deltas = [chunk.choices[0].delta.model_dump(exclude_none=True) for chunk in stream if chunk.choices]
    reasoning = "".join(delta.get("reasoning_content", "") for delta in deltas)
    content = "".join(delta.get("content", "") for delta in deltas)
    return whole.choices[0].message, (reasoning, content, deltas)


def test_when_the_template_opens_think_the_answer_is_reasoning_until_the_end_tag(qwen3: Server) -> None:
    raw = raw_text(qwen3)
    assert raw.strip() and "think>" not in raw  # the model never closed its thought
    message, (reasoning, content, _) = chat(qwen3, NO_EOS)
    assert message.reasoning_content == raw.strip() and message.content == ""  # type: ignore[attr-defined]
    assert (reasoning, content) == (raw.strip(), "")


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_content(qwen3: Server) -> None:
    with qwen3.http() as http:
        prompts = [
            http.post("/detokenize", json={"tokens": http.post("/tokenize", json=body).json()["tokens"]})
            for body in ({"messages": QUESTION}, {"messages": QUESTION, **NO_THINKING})
        ]
    thinking, not_thinking = (prompt.json()["prompt"] for prompt in prompts)
    assert thinking.endswith("assistant\n<think>\n") and not_thinking.endswith("<think>\n\n</think>\n\n")
    raw = raw_text(qwen3, **NO_THINKING)
    message, (reasoning, content, _) = chat(qwen3, {**NO_EOS, **NO_THINKING})
    assert message.content == raw and message.reasoning_content is None  # type: ignore[attr-defined]
    assert (reasoning, content) == ("", raw)


def test_tags_split_across_tokens_are_split_out_streamed_and_whole(qwen3: Server) -> None:
    raw = raw_text(qwen3, STEERED, **NO_THINKING)
    thought, answer = re.fullmatch(r"<think>([a-z]+)</think>([a-z]+)", raw).groups()  # type: ignore[union-attr]
    message, (reasoning, content, deltas) = chat(qwen3, {**STEERED, **NO_THINKING})
    assert (message.reasoning_content, message.content) == (thought, answer)  # type: ignore[attr-defined]
    assert (reasoning, content) == (thought, answer)
    # No piece of a tag leaks into a delta, and the reasoning all comes before the content.
    kinds = [kind for delta in deltas for kind in ("reasoning_content", "content") if delta.get(kind)]
    assert kinds == sorted(kinds, key=lambda kind: kind == "content") and len(kinds) > 2
    assert not any("<" in delta.get("reasoning_content", "") + delta.get("content", "") for delta in deltas)


def test_deepseek_r1_starts_in_reasoning_whatever_the_template(r1: Server) -> None:
    raw = raw_text(r1, **NO_THINKING)
    assert raw.strip() and "think>" not in raw
    message, (reasoning, content, _) = chat(r1, {**NO_EOS, **NO_THINKING})
    assert (message.reasoning_content, message.content) == (raw.strip(), "")  # type: ignore[attr-defined]
    assert (reasoning, content) == (raw.strip(), "")
    raw = raw_text(r1, STEERED)  # an output that writes <think> itself: the tag is dropped
    thought, answer = re.fullmatch(r"<think>([a-z]+)</think>([a-z]+)", raw).groups()  # type: ignore[union-attr]
    message, (reasoning, content, _) = chat(r1, STEERED)
    assert (message.reasoning_content, message.content) == (thought, answer)  # type: ignore[attr-defined]
    assert (reasoning, content) == (thought, answer)


def test_without_a_parser_the_tags_stay_in_the_content(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL,
        messages=QUESTION,
        **GREEDY,
        extra_body=STEERED,  # type: ignore[arg-type]
    )
    message = completion.choices[0].message
    assert re.fullmatch(TAGGED, message.content or "") and message.reasoning_content is None  # type: ignore[attr-defined]


def test_anthropic_thinking_blocks_when_the_request_enables_thinking(qwen3: Server) -> None:
    aclient = anthropic.Anthropic(base_url=qwen3.base_url, api_key="none", max_retries=0)
    thinking = raw_text(qwen3, ignore_eos=False)  # Anthropic's API has no ignore_eos
    request: dict[str, Any] = {
        "model": MODEL, "max_tokens": GREEDY["max_tokens"], "messages": QUESTION,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": {"temperature": 0},  # the client has no sampling parameters of its own any more
    }  # fmt: skip
    whole = aclient.messages.create(**request)
    assert [block.type for block in whole.content] == ["thinking"]
    assert whole.content[0].thinking == thinking.strip()  # type: ignore[union-attr]
    with aclient.messages.stream(**request) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content == whole.content
    assert events.count("content_block_start") == 1 and "thinking" in events  # the SDK's thinking_delta
    # Without `thinking` the model is asked not to think (Anthropic's models think only when
    # asked): the template closes an empty thought, and the answer is text.
    no_thinking = {**request, "thinking": {"type": "disabled"}}
    answer = raw_text(qwen3, ignore_eos=False, **NO_THINKING)
    whole = aclient.messages.create(**no_thinking)
    assert [block.type for block in whole.content] == ["text"] and whole.content[0].text == answer  # type: ignore[union-attr]
    counts = [
        aclient.messages.count_tokens(model=MODEL, messages=QUESTION, **thinks).input_tokens  # type: ignore[arg-type]
        for thinks in ({"thinking": request["thinking"]}, {})
    ]
    with qwen3.http() as http:
        expected = [
            len(http.post("/tokenize", json={"messages": QUESTION, **kwargs}).json()["tokens"])
            for kwargs in ({}, NO_THINKING)
        ]
    assert counts == expected and counts[0] < counts[1]


def test_ollama_think_shows_the_thinking_and_think_false_turns_it_off(qwen3: Server) -> None:
    oclient = ollama.Client(host=qwen3.base_url, timeout=120)
    options = {"temperature": 0, "num_predict": GREEDY["max_tokens"]}
    # Ollama's options have no ignore_eos
    thinking, answer = raw_text(qwen3, ignore_eos=False), raw_text(qwen3, ignore_eos=False, **NO_THINKING)
    whole = oclient.chat(model=MODEL, messages=QUESTION, options=options, think=True)
    assert (whole.message.thinking, whole.message.content) == (thinking.strip(), "")
    streamed = list(oclient.chat(model=MODEL, messages=QUESTION, options=options, think=True, stream=True))
    assert "".join(chunk.message.thinking or "" for chunk in streamed) == thinking.strip()
    assert sum(bool(chunk.message.thinking) for chunk in streamed) > 1  # as the tokens come
    off = oclient.chat(model=MODEL, messages=QUESTION, options=options, think=False)
    assert (off.message.thinking, off.message.content) == (None, answer)
    generated = oclient.generate(model=MODEL, prompt=QUESTION[0]["content"], options=options, think=True)
    assert generated.thinking == thinking.strip() and generated.response == ""


def test_a_bad_chat_template_kwarg_is_a_400_naming_it(qwen3: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        qwen3.client().chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            extra_body={"chat_template_kwargs": {"tokenize": False}},  # type: ignore[arg-type]
        )
    assert info.value.body["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert "tokenize" in info.value.message
