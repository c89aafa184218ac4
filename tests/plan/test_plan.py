"""`yaie plan` against arithmetic written out by hand from the models' published configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from yaie.cli import main
from yaie.errors import UnsupportedModelError
from yaie.plan import PRESETS, Overhead, PlanError, load_model_source, make_plan
from yaie.plan.memory import weight_bytes

GIB = 1 << 30
BLOCK = 16


def llama_layer(
    hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, experts: int = 1
) -> int:
    """q, k, v, o projections, a gated MLP per expert, a router when there are experts, two norms."""
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    router = hidden * experts if experts > 1 else 0
    return attention + experts * 3 * hidden * intermediate + router + 2 * hidden


def test_llama_3_8b() -> None:
    # vocab 128256, hidden 4096, 32 layers, 32 heads, 8 K/V heads of 128, intermediate 14336, untied.
    params = 2 * 128256 * 4096 + 32 * llama_layer(4096, 32, 8, 128, 14336) + 4096
    assert params == 8_030_261_248  # Meta's "8B"
    kv_per_token = 32 * 2 * 8 * 128 * 2  # layers, K and V, heads, head_dim, bf16
    plan = make_plan(load_model_source("Llama-3-8B"), dtype="bfloat16", kv_cache_memory=16 * GIB)
    assert (plan.num_parameters, plan.kv_bytes_per_token, plan.weight_bytes) == (
        params,
        kv_per_token,
        2 * params,
    )
    blocks = 16 * GIB // (BLOCK * kv_per_token)  # 8192 blocks of 2 MiB
    assert plan.kv_budget_blocks == blocks == 8192
    assert plan.kv_budget_tokens == blocks * BLOCK
    assert plan.max_sequences == {
        2048: blocks // 128,
        4096: blocks // 256,
        8192: blocks // 512,
        32768: None,
        131072: None,
    }


def test_llama_3_8b_on_an_80_gib_gpu() -> None:
    params = 2 * 128256 * 4096 + 32 * llama_layer(4096, 32, 8, 128, 14336) + 4096
    # 1 GiB framework + activations of 2048 tokens (hidden twice, q/k/v, gate and up) in bf16
    # + fp32 logits of 256 rows.
    overhead = GIB + 2048 * (2 * 4096 + (32 + 2 * 8) * 128 + 2 * 14336) * 2 + 256 * 128256 * 4
    kv_memory = 80 * GIB - 2 * params - overhead
    plan = make_plan(load_model_source("Llama-3-8B"), memory=80 * GIB, overhead=Overhead(GIB, 2048, 256))
    assert (plan.overhead_bytes_per_gpu, plan.kv_cache_bytes_per_gpu) == (overhead, kv_memory)
    assert plan.kv_budget_blocks == kv_memory // (BLOCK * 131072)
    assert plan.max_sequences[8192] == kv_memory // (512 * BLOCK * 131072)


def test_llama_3_70b_fp8_cache_over_two_gpus() -> None:
    # hidden 8192, 80 layers, 64 heads, 8 K/V heads of 128, intermediate 28672, untied.
    params = 2 * 128256 * 8192 + 80 * llama_layer(8192, 64, 8, 128, 28672) + 8192
    assert params == 70_553_706_496
    per_gpu_token = 80 * 2 * (8 // 2) * 128 * 1  # each GPU keeps 4 of the 8 K/V heads, one byte each
    plan = make_plan(
        load_model_source("Llama-3-70B"),
        kv_cache_dtype="fp8",
        kv_cache_memory=20 * GIB,
        tensor_parallel_size=2,
    )
    assert (plan.num_parameters, plan.kv_bytes_per_token, plan.kv_bytes_per_token_per_gpu) == (
        params, 80 * 2 * 8 * 128, per_gpu_token,
    )  # fmt: skip
    assert plan.weight_bytes_per_gpu == params  # bf16 weights, split in two
    blocks = 20 * GIB // (BLOCK * per_gpu_token)
    assert plan.kv_budget_blocks == blocks == 16384
    assert plan.max_sequences[4096] == blocks // (4096 // BLOCK) == 64


def test_mistral_7b_sliding_window_caps_the_cache() -> None:
    # vocab 32000, hidden 4096, 32 layers, 32 heads, 8 K/V heads, intermediate 14336, window 4096.
    params = 2 * 32000 * 4096 + 32 * llama_layer(4096, 32, 8, 128, 14336) + 4096
    assert params == 7_241_732_096
    plan = make_plan(load_model_source("Mistral-7B"), kv_cache_memory=16 * GIB)
    assert (plan.num_parameters, plan.kv_bytes_per_token) == (params, 32 * 2 * 8 * 128 * 2)
    window_seq = 32 * 4096 * (2 * 8 * 128 * 2)  # every layer keeps at most 4096 tokens: 512 MiB
    assert (
        plan.max_sequences[4096]
        == plan.max_sequences[8192]
        == plan.max_sequences[32768]
        == 16 * GIB // window_seq
    )
    assert plan.max_sequences[2048] == 16 * GIB // (window_seq // 2)


def test_mixtral_8x7b_counts_all_experts_and_the_active_two() -> None:
    total = 2 * 32000 * 4096 + 32 * llama_layer(4096, 32, 8, 128, 14336, experts=8) + 4096
    active = 2 * 32000 * 4096 + 32 * (llama_layer(4096, 32, 8, 128, 14336, experts=2) + 4096 * 6) + 4096
    assert (total, active) == (46_702_792_704, 12_879_925_248)  # the router scores all 8 experts
    plan = make_plan(load_model_source("Mixtral-8x7B"), kv_cache_memory=16 * GIB)
    assert (plan.num_parameters, plan.num_active_parameters) == (total, active)
    assert plan.kv_bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert plan.max_sequences[32768] == 8192 // 2048 == 4


def test_quantized_weights_keep_vectors_in_16_bits() -> None:
    source = load_model_source("SmolLM2-135M")
    vectors = 30 * 2 * 576 + 576  # two norms per layer and the final one
    expected = -(-(source.architecture.num_parameters - vectors) * 20 // 32) + 2 * vectors
    assert weight_bytes(source.architecture, "Q4_1") == expected


def test_bundled_model_budget_equals_the_engines_block_count() -> None:
    torch = pytest.importorskip("torch")
    from yaie.engine.engine import resolve_kv_cache_dtype
    from yaie.engine.model_runner import ModelRunner
    from yaie.model.config import ModelConfig
    from yaie.model.loader import bundled_model_path, open_checkpoint

    config = ModelConfig.from_hf(open_checkpoint(bundled_model_path()).hf_config())
    kv_cache_memory = 100 * (1 << 20) + 12345
    # The engine: num_blocks = kv_cache_memory // bytes_per_block, in the cache dtype `auto` picks
    # for the bundled file's quantized weights on the CPU, as the plan's `auto` does.
    for kv_cache_dtype in ("auto", "float32"):
        kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.float32, quantized=True)
        block_bytes = ModelRunner.bytes_per_block(config, BLOCK, kv_dtype)
        plan = make_plan(
            load_model_source(None), kv_cache_dtype=kv_cache_dtype, kv_cache_memory=kv_cache_memory
        )
        assert plan.bytes_per_block == block_bytes
        assert plan.kv_budget_blocks == kv_cache_memory // block_bytes


def test_every_preset_plans() -> None:
    for name in PRESETS:
        plan = make_plan(load_model_source(name), kv_cache_memory=8 * GIB)
        assert plan.num_parameters > 0 and plan.max_sequences[2048]


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(PlanError) as error:
        load_model_source("Llama-9-1T")
    assert all(name in str(error.value) for name in PRESETS)


def test_unsupported_config_names_the_missing_fields(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 768, "vocab_size": 50257}))
    with pytest.raises(UnsupportedModelError) as error:
        load_model_source(str(config))
    message = str(error.value)
    assert "GPT2LMHeadModel" in message
    assert "hidden_size, intermediate_size, num_hidden_layers, num_attention_heads" in message


def test_too_little_memory_says_by_how_much() -> None:
    params = 2 * 128256 * 8192 + 80 * llama_layer(8192, 64, 8, 128, 28672) + 8192
    overhead = GIB + 2048 * (2 * 8192 + (64 + 2 * 8) * 128 + 2 * 28672) * 2 + 256 * 128256 * 4
    shortfall = 2 * params + overhead - 80 * GIB
    with pytest.raises(PlanError) as error:
        make_plan(load_model_source("Llama-3-70B"), memory=80 * GIB)
    assert f"{shortfall / GIB:.2f} GiB more than the 80.00 GiB given" in str(error.value)


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "Llama-3-8B", "--kv-cache-memory", "16GiB", "--context", "2048,8k", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_parameters"] == 8_030_261_248
    assert (report["weight_bytes"], report["kv_bytes_per_token"]) == (2 * 8_030_261_248, 131072)
    assert (report["kv_budget_tokens"], report["max_sequences"]) == (8192 * BLOCK, {"2048": 64, "8192": 16})


def test_cli_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "Llama-3-70B", "--memory", "80GiB"]) == 1
    assert "more than the 80.00 GiB given" in capsys.readouterr().err
