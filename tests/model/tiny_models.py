"""Tiny random-weight HF checkpoints of every supported architecture, made on the spot.

Weights are re-drawn larger than HF's default init so that logits spread out and any wrong
weight or layout changes them well beyond the comparison tolerance.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from tests.model.gguf_writer import END_OF_TEXT, byte_level_vocab

CHAT_TEMPLATE = (
    "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def save_tokenizer(path: Path) -> int:
    """A byte-level BPE tokenizer (any text encodes); returns its vocabulary size."""
    tokens, merges = byte_level_vocab(60)
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges])
    tok = Tokenizer(bpe)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return len(tokens)


def _common(vocab_size: int, eos: int) -> dict:
    return dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=eos,
        eos_token_id=eos,
    )


def make_config(kind: str, vocab_size: int):
    c = _common(vocab_size, vocab_size - 1)
    if kind == "llama":  # GQA, untied
        return LlamaConfig(**c, tie_word_embeddings=False, rope_theta=50000.0)
    if kind == "llama-tied-llama3rope":
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**{**c, "num_key_value_heads": 4}, tie_word_embeddings=True, rope_parameters=rope)
    if kind == "mistral":
        return MistralConfig(**c, tie_word_embeddings=False, sliding_window=None)
    if kind == "qwen2":  # qkv bias, tied
        return Qwen2Config(**c, tie_word_embeddings=True)
    if kind == "qwen3":  # per-head q/k norm, head_dim not hidden/heads
        return Qwen3Config(**c, head_dim=32, tie_word_embeddings=False)
    raise ValueError(kind)


ARCHITECTURES = ["llama", "llama-tied-llama3rope", "mistral", "qwen2", "qwen3"]


def make_tiny_model(kind: str, path: Path, seed: int = 0) -> torch.nn.Module:
    """Save a tiny model + tokenizer into `path`; return the transformers model (fp32, eval)."""
    vocab_size = save_tokenizer(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind, vocab_size), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, 0.15)
    model.eval()
    model.save_pretrained(path)
    return model


def randomize(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights of O(1) activations, so that logits are O(1) and a wrong tensor or misplaced row shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 2:
                p.copy_(noise / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                p.copy_(0.5 * noise)
            else:  # norm weights
                p.copy_(1.0 + 0.2 * noise)
    return model.eval()
