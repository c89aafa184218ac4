"""Several API keys, each its tenant's (issue #38): how `yaie serve` reads them, what it refuses,
how the middleware tells tenants apart, and that a key in a URL is neither accepted nor logged.
No model: the middleware is driven through a tiny ASGI app."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from yaie.cli import build_parser, main
from yaie.cli.serve import RedactQueryStrings, api_keys
from yaie.server.middleware import RequireAPIKey, tenant_of


def test_repeated_keys_are_tenants_of_their_own_and_a_file_names_them(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}))
    assert api_keys(["sk-a", "sk-b"], None) == {"sk-a": "key-1", "sk-b": "key-2"}
    assert api_keys(["sk-a"], path) == {
        "sk-a": "key-1",
        "sk-alice-1": "alice",
        "sk-alice-2": "alice",
        "sk-bob": "bob",
    }
    assert api_keys(None, None) is None  # no key: an open server


@pytest.mark.parametrize(
    ("keys", "listed", "message"),
    [
        ([""], None, "an empty API key would let anyone in"),
        (["  "], None, "an empty API key would let anyone in"),
        (["sk a"], None, "cannot hold spaces"),
        (None, {"": "alice"}, "an empty API key would let anyone in"),
        (None, {"sk-a": ""}, "must be a non-empty string"),
        (None, {"sk-a": 7}, "must be a non-empty string"),
        (None, ["sk-a"], "expected a JSON object"),
        (None, {}, "expected a JSON object"),
        (["sk-a"], {"sk-a": "alice"}, "given twice"),
        (["sk-a"], {"sk-b": "key-1"}, "the tenant name 'key-1'"),
    ],
)
def test_keys_that_would_not_do_what_was_meant_are_refused(
    tmp_path: Path, keys: list[str] | None, listed: object, message: str
) -> None:
    path = None
    if listed is not None:
        path = tmp_path / "keys.json"
        path.write_text(json.dumps(listed))
    with pytest.raises(ValueError, match=message):
        api_keys(keys, path)


def test_a_keys_file_that_is_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_text("sk-a alice\n")
    with pytest.raises(ValueError, match="cannot read a JSON object"):
        api_keys(None, path)
    with pytest.raises(ValueError, match="cannot read"):
        api_keys(None, tmp_path / "missing.json")


def test_an_empty_key_stops_serve_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--api-key", ""]) == 1
    assert "an empty API key would let anyone in" in capsys.readouterr().err


def test_keys_on_the_command_line_replace_the_one_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("YAIE_API_KEY", "from-env")
    assert build_parser().parse_args(["serve"]).api_key == ["from-env"]
    args = build_parser().parse_args(["serve", "--api-key", "a", "--api-key", "b"])
    assert args.api_key == ["a", "b"]


def whose(request: Request) -> PlainTextResponse:
    return PlainTextResponse(tenant_of(request))


KEYS = {"sk-alice": "alice", "sk-alice-laptop": "alice", "sk-bob": "bob"}
APP = RequireAPIKey(Starlette(routes=[Route("/v1/whose", whose), Route("/health", whose)]), KEYS, {"/health"})


def get(path: str, headers: dict[str, str] | None = None) -> httpx.Response:
    async def request() -> httpx.Response:
        transport = httpx.ASGITransport(app=APP)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.get(path, headers=headers)

    return asyncio.run(request())


def test_each_key_opens_the_api_as_its_tenant() -> None:
    assert get("/v1/whose", {"Authorization": "Bearer sk-alice"}).text == "alice"
    assert get("/v1/whose", {"Authorization": "bearer sk-alice-laptop"}).text == "alice"
    assert get("/v1/whose", {"x-api-key": "sk-bob"}).text == "bob"
    assert get("/health").text == "anonymous"  # a public path: nobody's in particular
    for headers in ({}, {"Authorization": "Bearer sk-carol"}, {"Authorization": "sk-bob"}):
        refused = get("/v1/whose", headers)
        assert refused.status_code == 401
        assert refused.json()["error"]["message"] == "missing or incorrect API key"


def test_a_key_in_the_url_is_refused_saying_where_it_goes() -> None:
    refused = get("/v1/whose?api_key=sk-bob")
    assert refused.status_code == 401
    assert "a key in the URL is not accepted" in refused.json()["error"]["message"]
    assert "sk-bob" not in refused.text


def test_the_access_log_keeps_no_query_values() -> None:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5000", "GET", "/v1/models?api_key=sk-bob&x=1", "1.1", 401), None,
    )  # fmt: skip
    assert RedactQueryStrings().filter(record)
    assert (
        record.getMessage()
        == '127.0.0.1:5000 - "GET /v1/models?api_key=[redacted]&x=[redacted] HTTP/1.1" 401'
    )
