"""test_fuzz.py's hypothesis over Ollama's /api/chat, /api/generate, /api/embed and
/api/embeddings bodies: every answer is a 2xx or a 4xx with Ollama's error body
(`{"error": "..."}`), never a 5xx, and a stream that answered 200 ends done without an error
line."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.e2e_helpers import MODEL
from tests.e2e.test_fuzz import floats, ints, junk, messages, texts

pytestmark = pytest.mark.slow

options = st.fixed_dictionaries(
    # num_predict is always given and small, so that the accepted requests stay quick.
    {"num_predict": st.one_of(st.integers(0, 3), st.text(max_size=2), st.floats(0, 3))},
    optional={
        "temperature": floats, "top_p": floats, "top_k": ints, "min_p": floats, "seed": ints,
        "repeat_penalty": floats, "presence_penalty": floats, "frequency_penalty": floats,
        "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=3)), "num_ctx": junk, "mirostat": junk,
    },
)  # fmt: skip
common = {
    "stream": st.one_of(st.none(), st.booleans(), junk),
    "format": st.one_of(st.none(), st.just("json"), st.just(""), texts, st.just({"type": "object"}), junk),
    "keep_alive": junk,
    "think": junk,
    "junk": junk,
}
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, f"{MODEL}:latest"]), "messages": messages, "options": options},
    optional={**common, "tools": st.one_of(junk, st.just([{"type": "function"}]))},
)
generate_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.one_of(texts, junk), "options": options},
    optional={
        **common, "system": st.one_of(texts, junk), "raw": st.one_of(st.booleans(), junk),
        "template": st.one_of(texts, st.just("{{ .Prompt }}"), junk),
        "context": st.one_of(junk, st.lists(st.integers(-2, 60_000), max_size=3)), "suffix": junk,
    },
)  # fmt: skip
embed_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, f"{MODEL}:latest"]),
     "input": st.one_of(texts, st.lists(texts, max_size=3), junk)},
    optional={"truncate": st.one_of(st.booleans(), junk), "dimensions": ints, "options": junk,
              "keep_alive": junk},
)  # fmt: skip
embeddings_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": st.one_of(texts, junk)}, optional={"options": junk, "junk": junk}
)
requests = st.one_of(
    st.tuples(st.just("/api/chat"), chat_bodies),
    st.tuples(st.just("/api/generate"), generate_bodies),
    st.tuples(st.just("/api/embed"), embed_bodies),
    st.tuples(st.just("/api/embeddings"), embeddings_bodies),
)


@settings(max_examples=100, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests)
def test_no_ollama_request_gets_a_5xx(http: httpx.Client, request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    content = json.dumps(body).encode()  # NaN, Infinity and lone surrogates as clients send them
    response = http.post(path, content=content)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert isinstance(response.json()["error"], str)
        return
    if path.startswith("/api/embed"):  # one JSON object, never a stream
        field = "embeddings" if path == "/api/embed" else "embedding"
        assert field in response.json(), (body, response.text)
        return
    lines = [json.loads(line) for line in response.text.splitlines()]
    assert lines and lines[-1]["done"] is True and all("error" not in line for line in lines), (body, lines)
