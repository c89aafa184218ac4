"""A decoding step through a whole decoder layer in one native call (csrc/decode_layer.cpp).

A one-token step makes ~20 Python-level ops per layer between and around its matmuls (norms,
views, rope, the cache write, attention, the activation). With weights kept in 4 or 8 bits they
cost as much as the matmuls; with fp32 weights, a third as much. The native op runs the same
kernels in the same order without them, so it changes the speed of a step, never its result.

It applies to a layer without q/k norms whose four projections are all QuantizedLinear (float32
activations) or all oneDNN-packed Linear, and to a step in which every token is a sequence's
next one (no prompt or chunk, no speculative verification) with fewer rows than the quantized
matmul's DEQUANTIZED_FROM_ROWS; any other step runs the layer's Python forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from yaie.model import kernels, quant
from yaie.model.attention import AttentionMetadata
from yaie.model.layers import Linear
from yaie.model.quant import QuantizedLinear

if TYPE_CHECKING:
    from yaie.model.llama import DecoderLayer


def _projections(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _projection(layer: torch.nn.Module) -> list[torch.Tensor | None]:
    """As the native op takes a projection: [qweight, scales, mins or None, bias or None] for a
    quantized one, [packed weight, bias or None] for a dense one."""
    if isinstance(layer, QuantizedLinear):
        return [layer.qweight, layer.scales, layer.mins, layer.bias]
    assert isinstance(layer, Linear)
    return [layer.packed, layer.bias]


def _covered(projections: tuple[torch.nn.Module, ...], dtype: torch.dtype) -> bool:
    if all(isinstance(p, QuantizedLinear) for p in projections):
        # The quantized kernels take float32 activations, in the weight's own input order (GPTQ's
        # act-order permutes it, which only the layer's forward applies).
        return dtype == torch.float32 and all(p.in_order is None for p in projections)
    return all(isinstance(p, Linear) and p.packed is not None for p in projections)


class FusedDecode:
    """The decode path of one DecoderLayer; `for_layer` says whether the layer has one."""

    def __init__(self, layer: DecoderLayer) -> None:
        self.attn = layer.self_attn  # its k_cache / v_cache are assigned after the KV pool exists
        self.input_norm = layer.input_layernorm.weight
        self.post_attention_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.projections = [_projection(p) for p in _projections(layer)]
        self.intermediate_size = layer.mlp.intermediate_size

    @classmethod
    def for_layer(cls, layer: DecoderLayer) -> FusedDecode | None:
        """A FusedDecode for a DecoderLayer that the native op covers, else None."""
        norm = layer.input_layernorm
        covered = (
            _covered(_projections(layer), norm.weight.dtype)
            and layer.self_attn.q_norm is None
            and norm.eps == layer.post_attention_layernorm.eps
        )
        return cls(layer) if covered else None

    def runs(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can take the native path."""
        return (
            not meta.prefills
            and meta.decode_token_idx is None
            and x.shape[0] < quant.DEQUANTIZED_FROM_ROWS
            and kernels.available(x.device)
        )

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """DecoderLayer.forward's contract: (this layer's MLP output, the updated residual)."""
        cos, sin = rope
        qkv, o, gate_up, down = self.projections
        attn = self.attn
        out = torch.ops.yaie.decode_layer(
            x, residual, cos, sin, self.input_norm, self.post_attention_norm, self.eps,
            qkv, o, gate_up, down, attn.k_cache, attn.v_cache,
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
            attn.num_heads, attn.num_kv_heads, self.intermediate_size, quant.ISAS.index(quant.isa()),
        )  # fmt: skip
        return out, residual
