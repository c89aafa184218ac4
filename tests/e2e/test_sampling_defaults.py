"""The model's generation_config.json sampling defaults, through the server: a tiny HF model
whose file asks for greedy sampling and 6 new tokens at most, served in-process."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.model.tiny_models import make_tiny_model
from yaie.config import EngineConfig
from yaie.engine.async_engine import AsyncEngine
from yaie.engine.engine import Engine
from yaie.server.app import build_app

MAX_NEW_TOKENS = 6
SEEDS = range(8)
HELLO = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    path = tmp_path_factory.mktemp("tiny")
    make_tiny_model("llama", path)
    file = path / "generation_config.json"  # transformers wrote the token ids; add sampling fields
    file.write_text(json.dumps({**json.loads(file.read_text()), "temperature": 0.0, "max_new_tokens": 6}))
    config = EngineConfig(model=str(path), quantization="none", num_kv_blocks=64)
    async_engine = AsyncEngine(lambda: Engine(config))
    yield async_engine
    async_engine.shutdown()


def texts_and_lengths(
    async_engine: AsyncEngine, source: str, bodies: list[dict[str, Any]]
) -> list[tuple[str, int]]:
    """Each chat body (with ignore_eos, so that only max_tokens ends it) posted in turn to a
    server built with generation_config=`source`: (text, completion tokens)."""

    async def main() -> list[tuple[str, int]]:
        app = build_app(async_engine, "m", generation_config_source=source)
        transport = httpx.ASGITransport(app=app)
        results = []
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as http:
            for body in bodies:
                response = await http.post(
                    "/v1/chat/completions", json={"messages": HELLO, "ignore_eos": True, **body}
                )
                assert response.status_code == 200, response.text
                answer = response.json()
                results.append(
                    (answer["choices"][0]["message"]["content"], answer["usage"]["completion_tokens"])
                )
        return results

    return asyncio.run(main())


def test_omitted_fields_take_the_models_defaults(async_engine: AsyncEngine) -> None:
    [(greedy, _)] = texts_and_lengths(
        async_engine, "auto", [{"temperature": 0, "max_tokens": MAX_NEW_TOKENS}]
    )
    # Without temperature: the model's 0.0, whatever the seed; without max_tokens: its max_new_tokens.
    defaulted = texts_and_lengths(async_engine, "auto", [{"seed": seed} for seed in SEEDS])
    assert defaulted == [(greedy, MAX_NEW_TOKENS)] * len(SEEDS)
    # A field the request sets is the request's.
    sampled = texts_and_lengths(
        async_engine, "auto", [{"seed": seed, "temperature": 1.0, "max_tokens": 9} for seed in SEEDS]
    )
    assert {length for _, length in sampled} == {9}
    assert any(not text.startswith(greedy) for text, _ in sampled)


def test_vllm_source_ignores_the_models_file(async_engine: AsyncEngine) -> None:
    [(greedy, _)] = texts_and_lengths(
        async_engine, "vllm", [{"temperature": 0, "max_tokens": MAX_NEW_TOKENS}]
    )
    results = texts_and_lengths(async_engine, "vllm", [{"seed": seed} for seed in SEEDS[:4]])
    # The API's defaults: temperature 1.0, and max_tokens up to the server's own bound.
    assert all(length > MAX_NEW_TOKENS for _, length in results)
    assert any(not text.startswith(greedy) for text, _ in results)


def test_the_defaults_are_logged_once_at_start(
    async_engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="yaie.server.app"):
        build_app(async_engine, "m")
        build_app(async_engine, "m", generation_config_source="vllm")
    auto, vllm = [
        record.getMessage() for record in caplog.records if "default sampling" in record.getMessage()
    ]
    assert f"temperature=0.0, max_tokens={MAX_NEW_TOKENS} (from " in auto
    assert str(Path(async_engine.model_path) / "generation_config.json") in auto
    assert "none" in vllm and "temperature" not in vllm
