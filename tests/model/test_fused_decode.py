"""Decoding steps through csrc/decode_layer.cpp (yaie/model/fused_decode.py) against the layers'
Python forward: the native op runs the same kernels in the same order, so every token and every
logprob must be identical to the bit, for one sequence and for a batch, quantized in every ISA
path and dense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.model.gguf_writer import Q
from tests.model.test_quant_kernels import isa  # noqa: F401 (a fixture)
from tests.model.test_quantized_model import llama, qwen2, vocab, write, write_raw_types  # noqa: F401 (fixtures)
from tests.model.tiny_models import make_tiny_model
from yaie.llm import LLM
from yaie.model.fused_decode import FusedDecode
from yaie.sampling_params import SamplingParams

PROMPTS = ["the quick brown fox", "hello world, hello", "lazy dog jumps over"]


def quantized_llm(path: Path, quantization: str = "auto") -> LLM:
    # No prefix cache: both runs of a comparison compute every prompt token the same way.
    return LLM(str(path), quantization=quantization, num_kv_blocks=16, enable_prefix_caching=False)


def generate(llm: LLM, prompts: list[str]) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    outputs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [(step.token_id, step.logprob, step.top) for step in o.logprobs]) for o in outputs]


def fused_and_python(llm: LLM, prompts: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, int]:
    """The same generation with the native decode path, then with it turned off; and how many
    steps took the native path."""
    calls = 0
    native = FusedDecode.__call__

    def counted(self, *args):
        nonlocal calls
        calls += 1
        return native(self, *args)

    with monkeypatch.context() as m:
        m.setattr(FusedDecode, "__call__", counted)
        fused = generate(llm, prompts)
    with monkeypatch.context() as m:
        m.setattr(FusedDecode, "fits", lambda self, meta: False)
        python = generate(llm, prompts)
    return fused, python, calls


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0], ids=lambda q: q.name)
def test_native_decode_equals_the_python_layers(tmp_path, vocab, llama, qtype, batch, isa, monkeypatch):  # noqa: F811
    llm = quantized_llm(write(tmp_path, vocab, "llama", llama, qtype))
    fused, python, calls = fused_and_python(llm, PROMPTS[:batch], monkeypatch)
    assert fused == python
    assert calls > 0


@pytest.mark.parametrize("batch", [1, 3])
def test_k_quant_layers(tmp_path, vocab, batch, isa, monkeypatch):  # noqa: F811
    """A Q4_K_M-like file: q, k in Q4_K above v in Q6_K (one projection of two parts), o in Q5_K,
    a tied Q6_K table. The K-quant kernel is the same at any row count, so the native path takes
    every batch, and each sequence decodes as it does alone."""
    raw_types = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_K, "gate_proj": Q.Q4_K,
                 "up_proj": Q.Q4_K, "down_proj": Q.Q6_K}  # fmt: skip
    llm = quantized_llm(write_raw_types(tmp_path / "k.gguf", vocab, raw_types, Q.Q6_K, seed=3, tied=True))
    fused_decode = llm.engine.runner.fused_decode
    assert fused_decode is not None
    fused, python, calls = fused_and_python(llm, PROMPTS[:batch], monkeypatch)
    assert fused == python and calls > 0
    assert fused == [generate(llm, [p])[0] for p in PROMPTS[:batch]]


def test_q5_1_layers_beside_q8_0_ones(tmp_path, vocab, llama, isa, monkeypatch):  # noqa: F811
    """Q5_1's codes q and k fused with a Q8_0 v (as Q5_K_M files of models whose rows are not
    multiples of 256 store them), widened to 8-bit values with mins: still one layer, so the native
    path runs."""
    layers = range(llama.config.num_hidden_layers)
    overrides = {f"model.layers.{i}.self_attn.v_proj.weight": Q.Q8_0 for i in layers}
    llm = quantized_llm(write(tmp_path, vocab, "llama", llama, Q.Q5_1, type_overrides=overrides))
    assert llm.engine.runner.fused_decode is not None
    fused, python, calls = fused_and_python(llm, PROMPTS, monkeypatch)
    assert fused == python and calls > 0


def test_qkv_biases_and_a_tied_head(tmp_path, vocab, qwen2, native_kernels, monkeypatch):  # noqa: F811
    llm = quantized_llm(write(tmp_path, vocab, "qwen2", qwen2, Q.Q4_0))
    fused, python, calls = fused_and_python(llm, PROMPTS, monkeypatch)
    assert fused == python and calls > 0


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="dense weights are packed by oneDNN")
def test_dense_fp32_layers(tmp_path, vocab, llama, native_kernels, monkeypatch):  # noqa: F811
    llm = quantized_llm(write(tmp_path, vocab, "llama", llama, Q.Q4_1), quantization="none")
    fused_decode = llm.engine.runner.fused_decode
    assert fused_decode is not None
    fused, python, calls = fused_and_python(llm, PROMPTS, monkeypatch)
    assert fused == python and calls > 0


def test_qk_norm_layers_keep_the_python_forward(tmp_path, native_kernels):
    make_tiny_model("qwen3", tmp_path / "qwen3", seed=2)
    qwen3 = LLM(str(tmp_path / "qwen3"), quantization="int4", num_kv_blocks=8)
    assert qwen3.engine.runner.fused_decode is None


def test_without_native_kernels_the_python_forward_runs(tmp_path, vocab, llama, pytorch_only, monkeypatch):  # noqa: F811
    llm = LLM(str(write(tmp_path, vocab, "llama", llama, Q.Q4_1)), quantization="auto", num_kv_blocks=16)

    def native(*args):
        raise AssertionError("the native decode path ran without the native kernels")

    monkeypatch.setattr(FusedDecode, "__call__", native)
    assert len(generate(llm, PROMPTS[:1])[0][0]) == 12
