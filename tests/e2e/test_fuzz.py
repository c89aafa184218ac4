"""Hypothesis over chat, completion and embedding bodies, valid and not, against the shared server: every
answer is a 2xx or a 4xx with OpenAI's error body, never a 5xx, and the server is alive after."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.e2e_helpers import MODEL

pytestmark = pytest.mark.slow

# Text with lone surrogates, control characters and the rest of Unicode.
texts = st.text(st.characters(codec=None), max_size=40)
floats = st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True), st.integers(-(10**30), 10**30))
ints = st.one_of(st.none(), st.integers(-5, 5), st.integers(-(2**70), 2**70))
junk = st.one_of(st.none(), st.booleans(), texts, st.lists(st.integers(-2, 50_000), max_size=3))
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", "x"]), "content": texts}
    ),
    max_size=3,
)
sampling = {
    "temperature": floats,
    "top_p": floats,
    "top_k": ints,
    "min_p": floats,
    "presence_penalty": floats,
    "frequency_penalty": floats,
    "repetition_penalty": floats,
    "seed": ints,
    "n": st.integers(-1, 3),
    "stop": st.one_of(st.none(), texts, st.lists(texts, max_size=3)),
    "logit_bias": st.one_of(
        st.none(), st.dictionaries(st.one_of(texts, st.integers(-2, 60_000).map(str)), floats)
    ),
    "stream": st.booleans(),
    "logprobs": junk,
    "min_tokens": ints,
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(-2, 60_000), max_size=3)),
    "priority": st.one_of(ints, junk),  # the shared server is fcfs: only 0 (or null) is accepted
    "timeout": st.one_of(floats, junk),
    "junk": junk,
}
# max_tokens is always given and small, so that the accepted requests stay quick.
max_tokens = st.one_of(st.integers(-1, 3), st.just(10**9), st.text(max_size=2))
# Template variables: the one thinking templates read, ones the server sets itself, and any.
template_kwargs = st.one_of(
    junk,
    st.dictionaries(
        st.one_of(st.sampled_from(["enable_thinking", "tokenize", "messages", "raise_exception"]), texts),
        junk,
        max_size=2,
    ),
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": messages, "max_tokens": max_tokens},
    optional={**sampling, "chat_template_kwargs": template_kwargs},
)
completion_bodies = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "prompt": st.one_of(
            texts, st.lists(texts, max_size=2), st.lists(st.integers(-2, 60_000), max_size=4)
        ),
        "max_tokens": max_tokens,
    },
    optional={**sampling, "echo": st.booleans(), "logprobs": st.one_of(st.none(), st.integers(-1, 6))},
)
token_ids = st.lists(st.integers(-2, 60_000), max_size=4)
embedding_bodies = st.fixed_dictionaries(
    {
        "model": st.just(MODEL),
        "input": st.one_of(
            texts, st.lists(texts, max_size=3), token_ids, st.lists(token_ids, max_size=2), junk
        ),
    },
    optional={
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), junk),
        "dimensions": ints,
        "normalize": junk,
        "user": junk,
        "junk": junk,
    },
)
requests = st.one_of(
    st.tuples(st.just("/v1/chat/completions"), chat_bodies),
    st.tuples(st.just("/v1/completions"), completion_bodies),
    st.tuples(st.just("/v1/embeddings"), embedding_bodies),
)


@settings(max_examples=200, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=requests)
def test_no_request_gets_a_5xx(http: httpx.Client, request: tuple[str, dict[str, Any]]) -> None:
    path, body = request
    # Python's encoder writes NaN and Infinity as the issue sent them, and lone surrogates as
    # \\ud800 escapes (httpx's json= would refuse both).
    content = json.dumps(body).encode()
    response = http.post(path, content=content, headers={"Content-Type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert response.json()["error"]["message"]
    elif body.get("stream"):
        assert "data: [DONE]" in response.text
        assert '"error"' not in response.text, (body, response.text)
