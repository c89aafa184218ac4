"""Paged attention: K/V are written into fixed-size blocks and read back through block tables.

This is the one module that knows how attention touches the KV cache. Prompts run through
PyTorch's scaled_dot_product_attention (after gathering cached blocks, if any). Decoding tokens
run through the op backend's paged decode attention: the native kernel reads each sequence's
blocks in place (csrc/paged_attention.cpp), the torch one gathers them first.

Cache layout per layer: k_cache, v_cache of shape [num_blocks, block_size, kv_heads, head_dim].
Token t of a sequence lives in block `block_table[t // block_size]` at offset `t % block_size`;
its flat "slot" is block * block_size + offset.

The cache may store a narrower dtype than the model computes in (--kv-cache-dtype bfloat16 under
an fp32 model): K/V are rounded to it when written, and widened back to q's dtype when read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from yaie.ops import Ops
from yaie.ops.torch_ops import gather_blocks


@dataclass
class PrefillSeq:
    """One sequence computing several tokens this step (a prompt or a chunk of one)."""

    start: int  # first of its tokens in the flat batch
    num_tokens: int
    # Earlier tokens of the sequence already in the cache (a previous chunk, a prefix hit), and
    # the blocks that hold them.
    num_cached: int = 0
    block_table: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens]: where each new token's K/V goes
    prefills: list[PrefillSeq]
    # Decoding sequences (one new token each), batched into a single attention call.
    decode_token_idx: torch.Tensor | None = None  # [decodes] positions in the flat batch; None = all
    decode_block_tables: torch.Tensor | None = None  # [decodes, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [decodes]: keys each one attends to


def paged_attention(
    ops: Ops,
    q: torch.Tensor,  # [tokens, heads, head_dim]
    k: torch.Tensor,  # [tokens, kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Write the tokens' k and v into the cache, then each token's attention over its sequence:
    [tokens, heads, head_dim], in q's dtype."""
    ops.write_kv(k, v, meta.slot_mapping, k_cache, v_cache)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)

    for seq in meta.prefills:
        rows = slice(seq.start, seq.start + seq.num_tokens)
        # A leading batch dimension of 1: with 3-D inputs PyTorch's CPU build falls back to its
        # slow reference attention instead of the flash kernel.
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, n, head_dim]
        ks, vs = k[rows].transpose(0, 1).unsqueeze(0), v[rows].transpose(0, 1).unsqueeze(0)
        if seq.num_cached == 0:  # the whole context is in this batch: plain causal attention
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            assert seq.block_table is not None  # a sequence with cached tokens has their blocks
            cached_k = gather_blocks(k_cache, seq.block_table)[:, : seq.num_cached].unsqueeze(0).to(q.dtype)
            cached_v = gather_blocks(v_cache, seq.block_table)[:, : seq.num_cached].unsqueeze(0).to(q.dtype)
            o = _attend_after_cache(qs, cached_k, cached_v, ks, vs)
        out[rows] = o[0].transpose(0, 1)

    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    if tables is not None and lens is not None and len(tables):
        idx = meta.decode_token_idx
        o = ops.paged_decode_attention(q if idx is None else q[idx], k_cache, v_cache, tables, lens)
        if idx is None:
            out = o
        else:
            out[idx] = o
    return out


def _attend_after_cache(
    q: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """A chunk's queries [1, heads, n, dim] over the cached keys (all visible) and the chunk's own
    (causal). On CPUs the two parts run as separate flash-attention calls, merged by their
    log-sum-exps:

        keys:     | cached (all visible)  | chunk (causal)  |
        o = (o_cached * e^lse_cached + o_chunk * e^lse_chunk) / (e^lse_cached + e^lse_chunk)

    One call with an explicit [n, cached + n] mask gives the same result, but the mask stops the
    kernel from skipping the blocks above the diagonal and is read for every head, which makes
    long chunks after long cached prefixes slower (benchmarks/prefix_cache.py). Elsewhere that
    masked call is what runs.
    """
    if q.device.type != "cpu":
        return _attend_after_cache_masked(q, cached_k, cached_v, k, v)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_cached, lse_cached = flash(q, cached_k, cached_v)
    o_chunk, lse_chunk = flash(q, k, v, is_causal=True)
    top = torch.maximum(lse_cached, lse_chunk)
    w_cached, w_chunk = (lse_cached - top).exp().unsqueeze(-1), (lse_chunk - top).exp().unsqueeze(-1)
    out: torch.Tensor = (o_cached * w_cached + o_chunk * w_chunk) / (w_cached + w_chunk)
    return out


def _attend_after_cache_masked(
    q: torch.Tensor, cached_k: torch.Tensor, cached_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    """`_attend_after_cache` as one attention call over all keys with an explicit mask."""
    n, num_cached = q.shape[2], cached_k.shape[2]
    key_pos = torch.arange(num_cached + n, device=q.device)
    mask = key_pos <= torch.arange(num_cached, num_cached + n, device=q.device).unsqueeze(1)
    keys, values = torch.cat((cached_k, k), dim=2), torch.cat((cached_v, v), dim=2)
    return F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1]
    )
