"""Every op in PyTorch: the backend where the native kernels are not (another device, no
compiler, YAIE_NATIVE_KERNELS=0), and the reference the native ones are tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from yaie.ops.backend import Ops
from yaie.ops.kquant_layout import RECORD_ROWS, dequantize_kquant
from yaie.ops.quant_layout import GROUP_ROWS, dequantize_groups, dequantize_weight


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[..., max_blocks] block ids -> [..., kv_heads, max_blocks * block_size, head_dim]."""
    # index_select copies whole blocks (a memcpy each); advanced indexing (cache[block_table])
    # goes element by element and is several times slower, which long-context decoding feels.
    blocks = cache.index_select(0, block_table.flatten())
    blocks = blocks.view(*block_table.shape, *cache.shape[1:])  # [..., max_blocks, block_size, kv_heads, dim]
    return blocks.flatten(-4, -3).transpose(-3, -2)


class TorchOps(Ops):
    name = "torch"
    quant_isa = "none"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        residual.add_(x)
        return self.rms_norm(residual, weight, eps)

    def apply_rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin))

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        k = gather_blocks(k_cache, block_tables).to(q.dtype)  # [seqs, kv_heads, max_blocks * block_size, dim]
        v = gather_blocks(v_cache, block_tables).to(q.dtype)
        num_keys = k.shape[2]
        visible = torch.arange(num_keys, device=q.device) < context_lens.unsqueeze(1)  # [seqs, keys]
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            k,
            v,
            attn_mask=visible.view(len(context_lens), 1, 1, num_keys),
            enable_gqa=q.shape[1] != k_cache.shape[2],
        )
        return o.squeeze(2)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)

    def quantized_linear(
        self,
        x: torch.Tensor,
        qweight: torch.Tensor,
        scales: torch.Tensor,
        mins: torch.Tensor | None,
        bias: torch.Tensor | None,
        in_order: torch.Tensor | None,
        out_features: int,
    ) -> torch.Tensor:
        # The whole weight dequantized at every call: correct, slow.
        w = dequantize_weight(qweight, scales, mins, out_features, in_order)
        return F.linear(x.float(), w, bias).to(x.dtype)

    def quantized_embedding(
        self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor
    ) -> torch.Tensor:
        # The layout interleaves rows in groups of GROUP_ROWS: dequantize each token's group (a
        # few KiB) and keep its row.
        groups = dequantize_groups(qweight, scales, mins, ids // GROUP_ROWS)
        return groups[torch.arange(ids.shape[0], device=ids.device), ids % GROUP_ROWS]

    def kquant_linear(
        self, x: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        # The whole weight dequantized at every call, as quantized_linear's.
        w = torch.cat([dequantize_kquant(p) for p in parts])[:out_features]
        return F.linear(x.float(), w, bias).to(x.dtype)

    def kquant_embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        # Each token's record group (a few KiB a super-block) dequantized, and its row kept.
        groups = torch.stack([dequantize_kquant(table[g : g + 1]) for g in (ids // RECORD_ROWS).tolist()])
        return groups[torch.arange(ids.shape[0], device=ids.device), ids % RECORD_ROWS]
