"""Embeddings through the official clients against the shared server: OpenAI's /v1/embeddings
(`client.embeddings.create`, float and base64, every input shape) and Ollama's /api/embed and
/api/embeddings (`ollama.Client.embed` / `.embeddings`); the vectors are the engine's own, and
bad inputs get a 400 in each API's error shape."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import ollama
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server
from yaie import LLM

pytestmark = pytest.mark.slow

HIDDEN_SIZE = 576  # SmolLM2-135M's, the bundled model's
TEXTS = ["The cat sat on the mat.", "Stock markets fell sharply on Monday.", "A kitten rested on the rug."]


@pytest.fixture(scope="module")
def oclient(server: Server) -> ollama.Client:
    return ollama.Client(host=server.base_url, timeout=120)


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def assert_close(a: list[float], b: list[float], tol: float = 1e-5) -> None:
    assert len(a) == len(b)
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < tol


def test_vectors_are_the_engines(client: openai.OpenAI, llm: LLM) -> None:
    """Each served vector is what the engine pools for that text (last token, normalised), and
    a batch gives what each input gives alone."""
    batch = client.embeddings.create(model=MODEL, input=TEXTS)
    assert batch.object == "list" and batch.model == MODEL
    assert [item.index for item in batch.data] == [0, 1, 2]
    expected = llm.embed(TEXTS)
    assert (
        batch.usage.prompt_tokens
        == batch.usage.total_tokens
        == sum(len(e.prompt_token_ids) for e in expected)
    )
    for item, reference in zip(batch.data, expected, strict=True):
        assert item.object == "embedding" and len(item.embedding) == HIDDEN_SIZE
        assert norm(item.embedding) == pytest.approx(1.0, abs=1e-5)
        assert reference.pooled is not None
        assert_close(item.embedding, reference.pooled.data)
    alone = client.embeddings.create(model=MODEL, input=TEXTS[1]).data[0].embedding
    assert_close(alone, batch.data[1].embedding)
    assert (
        max(abs(x - y) for x, y in zip(batch.data[0].embedding, batch.data[1].embedding, strict=True)) > 1e-2
    )


def test_base64_is_the_same_float32_vector(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    # Asked for explicitly, base64 comes back as the string the server sent.
    encoded = (
        client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="base64").data[0].embedding
    )
    assert isinstance(encoded, str)
    raw = base64.b64decode(encoded)
    assert raw and len(raw) == 4 * HIDDEN_SIZE
    assert list(struct.unpack(f"<{HIDDEN_SIZE}f", raw)) == floats
    # Left out, the openai client asks for base64 itself and decodes it (numpy's float32) to the same floats.
    assert client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding == floats


def test_token_id_inputs_match_text(client: openai.OpenAI, server: Server) -> None:
    with server.http() as http:
        ids = [http.post("/tokenize", json={"prompt": text}).json()["tokens"] for text in TEXTS[:2]]
    by_text = client.embeddings.create(model=MODEL, input=TEXTS[:2])
    one = client.embeddings.create(model=MODEL, input=ids[0])
    many = client.embeddings.create(model=MODEL, input=ids)
    assert one.usage.prompt_tokens == len(ids[0])
    assert_close(one.data[0].embedding, by_text.data[0].embedding)
    for a, b in zip(many.data, by_text.data, strict=True):
        assert_close(a.embedding, b.embedding)


def test_normalize_false_gives_the_raw_vector(server: Server, client: openai.OpenAI) -> None:
    """vLLM's `normalize` extra field: the pooled state as it is, the normalised one scaled."""
    raw = client.embeddings.create(model=MODEL, input=TEXTS[0], extra_body={"normalize": False}).data[0]
    normalised = client.embeddings.create(model=MODEL, input=TEXTS[0]).data[0].embedding
    size = norm(raw.embedding)
    assert size > 1.5
    assert_close([x / size for x in raw.embedding], normalised)


def test_dimensions_of_the_models_size_is_accepted(client: openai.OpenAI) -> None:
    full = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=HIDDEN_SIZE)
    assert len(full.data[0].embedding) == HIDDEN_SIZE


def test_ollama_embed(oclient: ollama.Client, client: openai.OpenAI) -> None:
    response = oclient.embed(model=MODEL, input=TEXTS)
    assert response.model == MODEL and len(response.embeddings) == len(TEXTS)
    openai_vectors = client.embeddings.create(model=MODEL, input=TEXTS)
    for ours, theirs in zip(response.embeddings, openai_vectors.data, strict=True):
        assert_close(list(ours), theirs.embedding)
    assert response.prompt_eval_count == openai_vectors.usage.prompt_tokens
    assert response.total_duration and response.total_duration > 0 and response.load_duration == 0
    one = oclient.embed(model=f"{MODEL}:latest", input=TEXTS[0])
    assert_close(list(one.embeddings[0]), list(response.embeddings[0]))


def test_ollama_embed_truncates_to_the_context(oclient: ollama.Client, server: Server) -> None:
    with server.http() as http:
        max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
        long_text = "word " * (max_model_len + 100)
        response = http.post("/api/embed", json={"model": MODEL, "input": long_text})
        assert response.status_code == 200, response.text
        assert response.json()["prompt_eval_count"] == max_model_len
    with pytest.raises(ollama.ResponseError) as info:
        oclient.embed(model=MODEL, input=long_text, truncate=False)
    assert info.value.status_code == 400 and "context" in info.value.error


def test_ollama_empty_input_loads_the_model(oclient: ollama.Client) -> None:
    assert oclient.embed(model=MODEL, input="").embeddings == []
    assert oclient.embed(model=MODEL, input=[]).embeddings == []


def test_ollama_legacy_embeddings_is_not_normalised(oclient: ollama.Client) -> None:
    legacy = list(oclient.embeddings(model=MODEL, prompt=TEXTS[0]).embedding)
    normalised = list(oclient.embed(model=MODEL, input=TEXTS[0]).embeddings[0])
    size = norm(legacy)
    assert size > 1.5
    assert_close([x / size for x in legacy], normalised)
    assert list(oclient.embeddings(model=MODEL, prompt="").embedding) == []


OPENAI_CASES: list[tuple[str, dict[str, Any], str | None, int]] = [
    ("empty string", {"input": ""}, "input", 400),
    ("empty list", {"input": []}, "input", 400),
    ("an empty string in a list", {"input": ["a", ""]}, "input[1]", 400),
    ("an empty token list in a list", {"input": [[1, 2], []]}, "input[1]", 400),
    ("input missing", {}, "input", 400),
    ("input a number", {"input": 5}, "input", 400),
    ("mixed list", {"input": ["a", 5]}, "input[1]", 400),
    ("token id out of the vocabulary", {"input": [1, 10**9]}, "input", 400),
    ("negative token id", {"input": [[1], [-1]]}, "input[1]", 400),
    ("longer than the context", {"input": [1] * 9000}, "input", 400),
    ("dimensions", {"input": "a", "dimensions": 256}, "dimensions", 400),
    ("encoding_format", {"input": "a", "encoding_format": "int8"}, "encoding_format", 400),
    ("normalize wrong type", {"input": "a", "normalize": "yes"}, "normalize", 400),
    ("too many inputs", {"input": ["a"] * 2049}, "input", 400),
    ("unknown model", {"input": "a", "model": "gpt-4"}, "model", 404),
]


@pytest.mark.parametrize(
    ("case", "fields", "param", "status"), OPENAI_CASES, ids=[c[0] for c in OPENAI_CASES]
)
def test_bad_openai_input(
    server: Server, case: str, fields: dict[str, Any], param: str | None, status: int
) -> None:
    body = {"model": MODEL, **fields}
    with server.http() as http:
        response = http.post("/v1/embeddings", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error.keys() == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_bad_input_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64)
    assert "dimensions" in info.value.message and str(HIDDEN_SIZE) in info.value.message


@pytest.mark.parametrize(
    ("path", "body", "field", "status"),
    [
        ("/api/embed", {"input": "a"}, "model", 400),
        ("/api/embed", {"model": MODEL, "input": 5}, "input", 400),
        ("/api/embed", {"model": MODEL, "input": ["a", ""]}, "input[1]", 400),
        ("/api/embed", {"model": MODEL, "input": "a", "truncate": "no"}, "truncate", 400),
        ("/api/embed", {"model": MODEL, "input": "a", "dimensions": 8}, "dimensions", 400),
        ("/api/embed", {"model": "llama3", "input": "a"}, "llama3", 404),
        ("/api/embeddings", {"model": MODEL, "prompt": ["a"]}, "prompt", 400),
        ("/api/embeddings", {"prompt": "a"}, "model", 400),
    ],
)  # fmt: skip
def test_bad_input_in_ollamas_shape(server: Server, path: str, body: Any, field: str, status: int) -> None:
    with server.http() as http:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()
    assert list(error) == ["error"] and isinstance(error["error"], str) and field in error["error"]
