"""A decoding step through all the decoder layers in one native call (csrc/decode_layer.cpp).

A one-token step makes ~20 Python-level ops per layer between and around its matmuls (norms,
views, rope, the cache write, attention, the activation). With weights kept in 4 or 8 bits they
cost as much as the matmuls; with fp32 weights, a fraction as much. The native op runs the same
kernels in the same order without them, so it changes the speed of a step, never its result.
The layers' weights and KV caches go to the native side once, in a DecodeStack; a step passes
only what changes (the activations, the rope rows, the attention metadata). A call per layer
cost more in converting its twenty arguments than most of its kernels took.

Whether a model has this path is decided once, when the runner binds its KV cache
(`FusedDecode.for_model`): with the native op backend, every layer without q/k norms and its four
projections all quantized (QuantizedLinear or KQuantLinear; float32 activations, input features
in their own order) or all oneDNN-packed DenseLinear. The runner then takes it for every step it
`fits`: every token a sequence's next one (no prompt or chunk, no speculative verification),
and, with quantized weights in quant_layout's formats, fewer rows than the backend's quantized
matmul switches to dequantized tiles at (the native op always takes the int8 kernel, as the
layers' forward does below that; K-quant layers take their integer kernel at any row count).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, cast

import torch

from yaie.model.attention import AttentionMetadata
from yaie.model.linear import DenseLinear, Linear
from yaie.model.quantized_linear import KQuantLinear, QuantizedLinear
from yaie.ops import NativeOps
from yaie.ops.quant_layout import DEQUANTIZED_FROM_ROWS

if TYPE_CHECKING:
    from yaie.model.llama import CausalLM, DecoderLayer


def _projections(layer: DecoderLayer) -> tuple[Linear, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj


def _projection(layer: Linear) -> list[torch.Tensor | None]:
    """As the native op takes a projection: [qweight, scales, mins or None, bias or None] for a
    QuantizedLinear, [None, bias or None, part, ...] for a KQuantLinear, [packed weight, bias or
    None] for a dense one."""
    if isinstance(layer, KQuantLinear):
        return [None, layer.bias, *layer.parts]
    if isinstance(layer, QuantizedLinear):
        return [layer.qweight, layer.scales, layer.mins, layer.bias]
    assert isinstance(layer, DenseLinear)
    return [layer.packed, layer.bias]


def _max_rows(layers: list[DecoderLayer], ops: NativeOps) -> int:
    """The most rows a step may have to take the native path, or 0 where a layer is not covered."""
    tiles = False  # whether a layer's matmul switches to dequantized tiles at some row count
    for layer in layers:
        norm, projections = layer.input_layernorm, _projections(layer)
        if layer.self_attn.q_norm is not None or norm.eps != layer.post_attention_layernorm.eps:
            return 0
        if all(isinstance(p, (QuantizedLinear, KQuantLinear)) for p in projections):
            # The quantized kernels take float32 activations, in the weight's own input order
            # (GPTQ's act-order permutes it, which only the layer's forward applies).
            if norm.weight.dtype != torch.float32 or any(
                isinstance(p, QuantizedLinear) and p.in_order is not None for p in projections
            ):
                return 0
            tiles = tiles or any(isinstance(p, QuantizedLinear) for p in projections)
        elif not all(isinstance(p, DenseLinear) and p.packed is not None for p in projections):
            return 0
    return DEQUANTIZED_FROM_ROWS[ops.quant_isa] - 1 if tiles else sys.maxsize


class FusedDecode:
    """The native decode path of a model whose KV cache is bound; `for_model` says whether it has one."""

    def __init__(self, model: CausalLM, ops: NativeOps, max_rows: int) -> None:
        self.model = model
        self.isa_index = ops.isa_index
        self.max_rows = max_rows
        layers = cast("list[DecoderLayer]", list(model.layers))
        self._stack: Any = (
            torch.classes.yaie.DecodeStack()
        )  # the layers' weights and caches, on the native side
        for layer in layers:
            attn, norm = layer.self_attn, layer.input_layernorm
            qkv, o, gate_up, down = (_projection(p) for p in _projections(layer))
            self._stack.add_layer(
                norm.weight, layer.post_attention_layernorm.weight, norm.eps, qkv, o, gate_up, down,
                attn.k_cache, attn.v_cache, attn.num_heads, attn.num_kv_heads, layer.mlp.intermediate_size,
            )  # fmt: skip

    @classmethod
    def for_model(cls, model: CausalLM) -> FusedDecode | None:
        """The native path over every layer of `model` (its KV cache bound), or None where the
        native op does not cover them."""
        ops = model.ops
        if not isinstance(ops, NativeOps) or not len(model.layers):
            return None
        max_rows = _max_rows(cast("list[DecoderLayer]", list(model.layers)), ops)
        return cls(model, ops, max_rows) if max_rows > 0 else None

    def fits(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens described by `meta` can take the native path."""
        return not meta.prefills and meta.decode_token_idx is None and num_tokens <= self.max_rows

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """CausalLM.forward with the layers' loop in one native call: [tokens] ids -> [tokens,
        hidden] final hidden states (normed). Each layer keeps DecoderLayer.forward's contract:
        x is the previous layer's MLP output, which the op adds to `residual` in place."""
        model = self.model
        residual: torch.Tensor = model.embed_tokens(input_ids)  # [tokens, hidden]
        cos, sin = model.rope(positions, residual.dtype)
        x: torch.Tensor = torch.ops.yaie.decode_layers(
            torch.zeros_like(residual), residual, cos, sin, meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context_lens, self._stack, self.isa_index,
        )  # fmt: skip
        return model.norm.add_forward(x, residual)
