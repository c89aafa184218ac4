"""The bundled model with speculation gives transformers' greedy reference tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.model.loader import bundled_model_path

REFERENCE = json.loads((Path(__file__).resolve().parents[1] / "data" / "hf_greedy.json").read_text())
ALWAYS = {"disable_by_batch_size": 1024, "min_acceptance_rate": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec",
    [
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, **ALWAYS},
        {"method": "draft_model", "model": str(bundled_model_path()), "num_speculative_tokens": 3, **ALWAYS},
        # The Q4_1 file run in float32, its stored Q4_1 weights drafting.
        {"method": "self", "num_speculative_tokens": 4, **ALWAYS},
    ],
    ids=["ngram", "draft_model", "self"],
)
def test_greedy_reference_with_speculation(spec: dict) -> None:
    llm = LLM(num_kv_blocks=512, quantization="none", speculative_config=spec)
    results = REFERENCE["results"]
    outputs = llm.generate([r["prompt_ids"] for r in results], SamplingParams(temperature=0, max_tokens=32))
    for expected, output in zip(results, outputs, strict=True):
        assert output.outputs[0].token_ids == expected["generated_ids"], expected["prompt"]
    assert llm.engine.stats().spec_decode.num_accepted_tokens > 0  # type: ignore[union-attr]
    assert_no_leak(llm)
