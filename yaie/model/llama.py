"""The decoder-only transformer behind every supported architecture.

Llama, Mistral, Qwen2 and Qwen3 differ only in two switches (qkv bias, per-head q/k norm), so
one model covers them. Tokens arrive packed: a step's prompts, prompt chunks and decode tokens
are one flat [tokens] batch, so linear layers never see padding. Only attention needs to know
where one sequence ends and the next begins; `AttentionMetadata` tells it.

The model knows only its own parameter names; yaie/model/loader.py maps checkpoints onto them.
"""

from __future__ import annotations

import torch
from torch import nn

from yaie.model import kernels
from yaie.model.attention import AttentionMetadata, paged_attention
from yaie.model.config import ModelConfig
from yaie.model.fused_decode import FusedDecode
from yaie.model.layers import Embedding, GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rope, rope_inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Views into the runner's KV tensor, assigned by CausalLM.bind_kv_cache.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q_heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.q_norm is None or self.k_norm is None:  # no q/k norms: rotate q and k heads in one go
            qk = apply_rope(qkv[:, : q_heads + kv_heads], rope)
            q, k = qk[:, :q_heads], qk[:, q_heads:]
        else:
            q = apply_rope(self.q_norm(qkv[:, :q_heads]), rope)
            k = apply_rope(self.k_norm(qkv[:, q_heads : q_heads + kv_heads]), rope)
        v = qkv[:, q_heads + kv_heads :]
        o = paged_attention(q, k, v, self.k_cache, self.v_cache, meta)
        return self.o_proj(o.flatten(1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output, not yet added to `residual` (the running sum of
        the embedding and every sublayer's output). Returns this layer's pair."""
        h, residual = self.input_layernorm.add_forward(x, residual)
        h = self.self_attn(h, rope, meta)
        h, residual = self.post_attention_layernorm.add_forward(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        # An Embedding, or the loader's QuantizedEmbedding where the file stores the table quantized.
        self.embed_tokens: nn.Module = Embedding(cfg.vocab_size, cfg.hidden_size)
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # With tied embeddings the loader fills this with a copy of the embedding table (or, if
        # the table is quantized, makes it the one table both use).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        # Set by pack() where the native decode call covers every layer (yaie/model/fused_decode.py),
        # made anew by bind_kv_cache.
        self.fused_decode: FusedDecode | None = None

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """[tokens] ids -> [tokens, hidden] final hidden states (normed)."""
        residual = self.embed_tokens(input_ids)
        x = torch.zeros_like(residual)  # nothing to add before the first layer
        rope = self.rope(positions, residual.dtype)
        if self.fused_decode is not None and self.fused_decode.runs(x, meta):
            x, residual = self.fused_decode(x, residual, rope, meta)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, rope, meta)
        return self.norm.add_forward(x, residual)[0]

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """Give each layer its part of the KV cache, [layers, K/V, blocks, block_size, kv_heads,
        head_dim]; the native decode path takes the caches with the weights, so it is made anew."""
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv[0], kv[1]
        if self.fused_decode is not None:
            self.fused_decode = FusedDecode(list(self.layers))

    def pack(self) -> None:
        """Switch every projection to its fast inference layout; call once, after loading. Also
        builds the native kernels now (if they can be), rather than in the first step."""
        kernels.available(self.device)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        self.fused_decode = FusedDecode.for_layers(list(self.layers))
