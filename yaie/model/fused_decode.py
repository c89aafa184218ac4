"""A decoding step through a whole decoder layer in one native call (csrc/decode_layer.cpp).

With weights kept in 4 or 8 bits a one-token step reads little memory, and the ~20 Python-level
ops each layer makes between its matmuls (norms, views, rope, the cache write, attention, the
activation) cost as much as the matmuls. The native op runs the same kernels in the same order
without them, so it changes the speed of a step, never its result.

It applies to a layer whose four projections are QuantizedLinear and that has no q/k norms, in
float32, and to a step in which every token is a sequence's next one (no prompt or chunk, no
speculative verification) and there are fewer than the quantized matmul's DEQUANTIZED_FROM_ROWS;
any other step runs the layer's Python forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from yaie.model import quant
from yaie.model.attention import AttentionMetadata
from yaie.model.quant import QuantizedLinear

if TYPE_CHECKING:
    from yaie.model.llama import DecoderLayer


def _projections(layer: DecoderLayer) -> tuple[torch.nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _projection(layer: QuantizedLinear) -> list[torch.Tensor | None]:
    """As the native op takes a projection: [qweight, scales, mins or None, bias or None]."""
    return [layer.qweight, layer.scales, layer.mins, layer.bias]


class FusedDecode:
    """The decode path of one DecoderLayer; `for_layer` says whether the layer has one."""

    def __init__(self, layer: DecoderLayer) -> None:
        self.attn = layer.self_attn  # its k_cache / v_cache are assigned after the KV pool exists
        self.input_norm = layer.input_layernorm.weight
        self.post_attention_norm = layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.eps
        self.projections = [_projection(p) for p in _projections(layer)]  # type: ignore[arg-type]
        self.intermediate_size = layer.mlp.intermediate_size

    @classmethod
    def for_layer(cls, layer: DecoderLayer) -> FusedDecode | None:
        """A FusedDecode for a DecoderLayer that the native op covers, else None."""
        quantized = all(isinstance(p, QuantizedLinear) for p in _projections(layer))
        covered = (
            quantized
            and layer.self_attn.q_norm is None
            and layer.input_layernorm.weight.dtype == torch.float32
            and layer.input_layernorm.eps == layer.post_attention_layernorm.eps
        )
        return cls(layer) if covered else None

    def runs(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can take the native path."""
        return (
            not meta.prefills
            and meta.decode_token_idx is None
            and x.shape[0] < quant.DEQUANTIZED_FROM_ROWS
            and x.device.type == "cpu"
            and quant.isa() != "none"
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
