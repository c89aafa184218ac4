"""The decoder-only transformer behind every supported architecture.

Llama, Mistral, Qwen2 and Qwen3 differ only in two switches (qkv bias, per-head q/k norm), so
one model covers them. Tokens arrive packed: a step's prompts, prompt chunks and decode tokens
are one flat [tokens] batch, so linear layers never see padding. Only attention needs to know
where one sequence ends and the next begins; `AttentionMetadata` tells it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from yaie.model import kernels
from yaie.model.attention import AttentionMetadata, paged_attention
from yaie.model.config import ModelConfig
from yaie.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, apply_rope, rope_inv_freq

# HF per-layer names that land in our fused projections: (our parameter, shard).
_HF_FUSED_NAMES = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", "q"),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", "k"),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", "v"),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", "q"),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", "k"),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", "v"),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", "gate"),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", "up"),
}


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Views into the runner's KV tensor, assigned after the cache is allocated.
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x).view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        q_heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.q_norm is None:  # rotate the q and k heads in one go
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
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.rope = RotaryEmbedding(cfg.head_dim, max_positions, inv_freq)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # With tied embeddings the output projection reuses the embedding table (copied in pack()).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """[tokens] ids -> [tokens, hidden] final hidden states (normed)."""
        residual = F.embedding(input_ids, self.embed_tokens)
        x = torch.zeros_like(residual)  # nothing to add before the first layer
        rope = self.rope(positions, residual.dtype)
        for layer in self.layers:
            x, residual = layer(x, residual, rope, meta)
        return self.norm.add_forward(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def pack(self) -> None:
        """Switch every projection to its fast inference layout; call once, after loading. Also
        builds the native kernels now (if they can be), rather than in the first step."""
        kernels.available(self.embed_tokens.device)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused) parameters; complain about leftovers."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = self._param_for(hf_name)
            if target is None:
                continue  # tensors we never use (rotary inv_freq buffers, tied lm_head copies)
            name, rows = target
            param = params.get(name)
            if param is None:
                raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model ({name})")
            dest = param.data if rows is None else param.data[self._rows(name, rows)]
            if dest.shape != tensor.shape:
                raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(f"{name}:{rows}")
        if self.config.tie_word_embeddings:
            self.lm_head.weight.copy_(self.embed_tokens)
            loaded.add("lm_head.weight:None")
        expected = {f"{n}:{r}" for n in params for r in self._shards_of(n)}
        # A bias left out of a checkpoint is a zero bias, which is what Linear starts with.
        missing = {key for key in expected - loaded if ".bias:" not in key}
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")

    def _param_for(self, hf_name: str) -> tuple[str, str | None] | None:
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens", None
        if hf_name == "model.norm.weight":
            return "norm.weight", None
        if hf_name == "lm_head.weight":
            return None if self.config.tie_word_embeddings else ("lm_head.weight", None)
        if not hf_name.startswith("model.layers."):
            return None
        index, rest = hf_name[len("model.layers.") :].split(".", 1)
        if rest in _HF_FUSED_NAMES:
            suffix, shard = _HF_FUSED_NAMES[rest]
            return f"layers.{index}.{suffix}", shard
        if rest.endswith("rotary_emb.inv_freq"):
            return None
        # input_layernorm, post_attention_layernorm, self_attn.{q,k}_norm keep their HF names.
        return f"layers.{index}.{rest}", None

    def _rows(self, name: str, shard: str) -> slice:
        cfg = self.config
        if shard in ("gate", "up"):
            n = cfg.intermediate_size
            return slice(0, n) if shard == "gate" else slice(n, 2 * n)
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]

    @staticmethod
    def _shards_of(name: str) -> tuple[str | None, ...]:
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            return ("q", "k", "v")
        if name.endswith("gate_up_proj.weight"):
            return ("gate", "up")
        return (None,)
