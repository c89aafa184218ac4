"""--kv-cache-dtype on the bundled SmolLM2-135M-Instruct: a 16-bit cache under the fp32 model holds
twice the blocks in the same memory, and greedy decoding still gives transformers' fp32 tokens."""

from __future__ import annotations

import pytest
import torch

from tests.engine.engine_helpers import assert_no_leak
from yaie import LLM, SamplingParams
from yaie.config import EngineConfig
from yaie.engine.resources import resolve_kv_cache_dtype


@pytest.mark.slow
def test_a_16_bit_cache_holds_twice_the_blocks_in_the_same_memory(llm):
    memory = 100 * llm.engine.kv_block_bytes + 1000  # fp32: 100 blocks and change, rounded down
    full = LLM(kv_cache_memory=memory, quantization="none").engine
    assert full.model_info.kv_cache_dtype == "float32"  # auto: the dense model's dtype
    assert full.stats().num_kv_blocks == 100
    for kv_cache_dtype in ("bfloat16", "float16"):
        half = LLM(kv_cache_memory=memory, kv_cache_dtype=kv_cache_dtype, quantization="none").engine
        assert half.model_info.kv_cache_dtype == kv_cache_dtype
        assert str(half.runner.kv_cache.dtype) == f"torch.{kv_cache_dtype}"
        assert half.kv_block_bytes * 2 == full.kv_block_bytes
        assert half.stats().num_kv_blocks == 200
        # The bytes the metrics report per block are the pool's own.
        assert half.runner.kv_cache.nbytes == 200 * half.stats().kv_block_bytes <= memory


@pytest.mark.parametrize(
    ("dtype", "quantized", "expected"),
    [
        (torch.float32, False, torch.float32),  # dense: its own dtype, transformers' exact K/V
        (torch.float32, True, torch.float16),  # quantized weights computing in fp32: llama.cpp's f16
        (torch.bfloat16, True, torch.bfloat16),  # already 16-bit: the compute dtype
        (torch.bfloat16, False, torch.bfloat16),
    ],
)
def test_auto_kv_cache_dtype(dtype, quantized, expected):
    assert resolve_kv_cache_dtype("auto", dtype, quantized) == expected
    assert resolve_kv_cache_dtype("float32", dtype, quantized) == torch.float32  # asked for: kept


@pytest.mark.slow
def test_the_bundled_quantized_model_caches_float16_by_default():
    engine = LLM(num_kv_blocks=8).engine  # the GGUF's Q4_1 weights, as stored
    assert engine.model_info.quantization != "none"
    assert engine.model_info.kv_cache_dtype == "float16"
    assert engine.runner.kv_cache.dtype == torch.float16


@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_greedy_with_a_16_bit_cache_matches_transformers_reference(reference, kv_cache_dtype):
    """The same tokens as transformers in fp32 (tests/data/hf_greedy.json, which the fp32 cache
    matches too): rounding K/V to 16 bits moves each by at most 2^-8 (bf16) or 2^-11 (fp16) of
    itself, which at these greedy steps does not change the most likely token. The prompts
    are prefilled in 16-token chunks, so later chunks read the earlier ones from the 16-bit cache
    (the prefill path), and every generated token reads it through decode attention."""
    llm = LLM(
        num_kv_blocks=256, kv_cache_dtype=kv_cache_dtype, max_num_batched_tokens=16, block_size=8,
        quantization="none",  # transformers' exact weights
    )  # fmt: skip
    results = reference["results"]
    outputs = llm.generate([r["prompt_ids"] for r in results], SamplingParams(temperature=0, max_tokens=32))
    for expected, output in zip(results, outputs, strict=True):
        assert output.outputs[0].token_ids == expected["generated_ids"], expected["prompt"]
    assert_no_leak(llm)


def test_an_unknown_kv_cache_dtype_is_refused_with_the_choices():
    message = "kv_cache_dtype must be one of auto, float32, bfloat16, float16; got 'fp8'"
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_cache_dtype="fp8")
