"""Unknown routes and methods through each API's own client against the shared server: a 404 or
405 in the shape of the API the path belongs to, naming the method and path, and saying what
this server serves; and `GET /v1/models/{id}`."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.e2e.e2e_helpers import MODEL, Server

pytestmark = pytest.mark.slow

# Every API family's endpoints appear in a 404's list of what is served.
SERVED = ("POST /v1/chat/completions", "GET /v1/models", "POST /v1/messages", "POST /api/chat", "GET /health")


def test_an_unknown_openai_route_is_a_404_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.files.list()
    message = info.value.message
    assert "GET /v1/files" in message and "no such route" in message
    assert all(route in message for route in SERVED), message
    body = info.value.response.json()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] is None


def test_a_route_without_v1_is_pointed_to_it(server: Server) -> None:
    with server.http() as http:
        response = http.post("/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 404
    assert "did you mean /v1/chat/completions?" in response.json()["error"]["message"]


def test_an_unknown_anthropic_route_is_a_404_in_anthropics_shape(server: Server) -> None:
    aclient = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as info:
        aclient.messages.batches.list()
    body = info.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert "GET /v1/messages/batches" in body["error"]["message"]
    assert all(route in body["error"]["message"] for route in SERVED)


def test_an_unknown_ollama_route_is_a_404_in_ollamas_shape(server: Server) -> None:
    oclient = ollama.Client(host=server.base_url, timeout=60)
    with pytest.raises(ollama.ResponseError) as info:
        oclient.pull(MODEL)
    assert info.value.status_code == 404
    assert "POST /api/pull" in info.value.error and "POST /api/chat" in info.value.error
    with server.http() as http:
        raw = http.delete("/api/delete", params={"model": MODEL})
    assert raw.status_code == 404 and raw.json().keys() == {"error"}


@pytest.mark.parametrize(
    ("method", "path", "allowed", "shape"),
    [
        ("GET", "/v1/chat/completions", "POST", "openai"),
        ("PUT", "/v1/responses/resp_x", "DELETE, GET", "openai"),  # two routes, one per method
        ("DELETE", "/v1/models", "GET", "openai"),
        ("GET", "/v1/messages", "POST", "anthropic"),
        ("GET", "/api/chat", "POST", "ollama"),
        ("POST", "/health", "GET", "openai"),
    ],
)
def test_a_wrong_method_is_a_405_naming_the_allowed_ones(
    server: Server, method: str, path: str, allowed: str, shape: str
) -> None:
    with server.http() as http:
        response = http.request(method, path)
    assert response.status_code == 405, response.text
    assert response.headers["allow"] == allowed
    body = response.json()
    message = {
        "openai": lambda: body["error"]["message"],
        "anthropic": lambda: body["type"] == "error" and body["error"]["message"],
        "ollama": lambda: body["error"],
    }[shape]()
    assert isinstance(message, str) and f"{method} {path}" in message and allowed in message


def test_the_server_still_serves_after_unknown_routes(server: Server, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_a_model_is_retrieved_by_its_id(client: openai.OpenAI) -> None:
    [listed] = client.models.list().data
    model = client.models.retrieve(MODEL)
    assert model == listed and model.id == MODEL and model.object == "model"


def test_an_unknown_model_id_is_a_404_model_not_found(client: openai.OpenAI) -> None:
    for name in ("gpt-4o", "org/some-model"):  # a name with a slash is one id, not a deeper path
        with pytest.raises(openai.NotFoundError) as info:
            client.models.retrieve(name)
        error = info.value.response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert name in error["message"]
