"""Checkpoint tensors (HF names) into our parameters: renames, fused q/k/v and gate/up shards,
the checks that catch an incomplete or foreign checkpoint, and progress reporting."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors import safe_open

from tests.model.tiny_models import make_tiny_model
from yaie.model.config import ModelConfig
from yaie.model.llama import CausalLM
from yaie.model.loader import load_model, load_weights, our_name, shard_rows
from yaie.ops import TorchOps

CONFIG = ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=24,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=64,
    qkv_bias=True,
)


def hf_checkpoint(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Random tensors of every HF name and shape a checkpoint of `cfg` has."""
    gen = torch.Generator().manual_seed(0)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, hidden), "model.norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q, hidden),
            p + "self_attn.k_proj.weight": (kv, hidden),
            p + "self_attn.v_proj.weight": (kv, hidden),
            p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (hidden, q),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def empty_model(cfg: ModelConfig) -> CausalLM:
    model = CausalLM(cfg, cfg.max_position_embeddings, TorchOps())
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))  # so that a parameter the loader skips shows
    return model


def test_fused_projections_stack_their_shards_in_order():
    weights = hf_checkpoint(CONFIG)
    model = empty_model(CONFIG)
    load_weights(model, weights.items())
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    hf = "model.layers.1."
    for kind in ("weight", "bias"):
        expected = torch.cat([weights[f"{hf}self_attn.{p}_proj.{kind}"] for p in "qkv"])
        assert torch.equal(getattr(attn.qkv_proj, kind), expected)
    gate_up = torch.cat([weights[hf + "mlp.gate_proj.weight"], weights[hf + "mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(model.embed_tokens.weight, weights["model.embed_tokens.weight"])
    assert torch.equal(model.lm_head.weight, weights["lm_head.weight"])
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert torch.equal(model.layers[0].input_layernorm.weight, norm)
    assert not any(param.isnan().any() for param in model.parameters())


def test_tied_embeddings_fill_the_output_projection():
    cfg = ModelConfig(**{**vars(CONFIG), "tie_word_embeddings": True})
    weights = hf_checkpoint(cfg)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(2)  # old checkpoints carry it
    model = empty_model(cfg)
    load_weights(model, weights.items())
    assert torch.equal(model.lm_head.weight, weights["model.embed_tokens.weight"])
    assert our_name("lm_head.weight", cfg) is None


def test_names_and_rows():
    k_bias = ("layers.3.self_attn.qkv_proj.bias", "k_proj")
    assert our_name("model.layers.3.self_attn.k_proj.bias", CONFIG) == k_bias
    assert our_name("model.layers.0.mlp.down_proj.weight", CONFIG) == ("layers.0.mlp.down_proj.weight", None)
    assert our_name("model.embed_tokens.weight", CONFIG) == ("embed_tokens.weight", None)
    assert our_name("lm_head.weight", CONFIG) == ("lm_head.weight", None)
    # q is 16 rows, k and v 8 each; gate and up the intermediate size each.
    assert [shard_rows(CONFIG, p) for p in ("q_proj", "k_proj", "v_proj")] == [
        slice(0, 16), slice(16, 24), slice(24, 32)
    ]
    assert shard_rows(CONFIG, "up_proj") == slice(24, 48)


def test_a_missing_shard_is_named():
    weights = hf_checkpoint(CONFIG)
    del weights["model.layers.1.self_attn.v_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.qkv_proj\.weight\[v_proj\]"):
        load_weights(empty_model(CONFIG), weights.items())


def test_a_missing_bias_is_a_zero_bias():
    weights = hf_checkpoint(CONFIG)
    del weights["model.layers.0.self_attn.k_proj.bias"]
    model = CausalLM(CONFIG, CONFIG.max_position_embeddings, TorchOps())
    load_weights(model, weights.items())
    k_rows = shard_rows(CONFIG, "k_proj")
    assert torch.equal(model.layers[0].self_attn.qkv_proj.bias[k_rows], torch.zeros(8))


def test_a_tensor_with_no_place_is_refused():
    weights = hf_checkpoint(CONFIG)
    weights["model.layers.0.mlp.experts.0.weight"] = torch.zeros(4)
    with pytest.raises(KeyError, match="experts"):
        load_weights(empty_model(CONFIG), weights.items())


def test_a_tensor_of_the_wrong_shape_is_refused():
    weights = hf_checkpoint(CONFIG)
    weights["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(8, 16)
    with pytest.raises(ValueError, match=r"q_proj\.weight: checkpoint shape"):
        load_weights(empty_model(CONFIG), weights.items())


def test_load_model_reports_progress_and_logs(tmp_path, pytorch_only, caplog):
    make_tiny_model("qwen2", tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        total = len(list(f.keys()))
    calls: list[tuple[int, int]] = []
    with caplog.at_level(logging.INFO, logger="yaie"):
        load_model(str(tmp_path), torch.float32, torch.device("cpu"), progress=lambda *c: calls.append(c))
    assert calls == [(done, total) for done in range(1, total + 1)]
    assert any(r.message.startswith("loaded ") and "Qwen2ForCausalLM" in r.message for r in caplog.records)
