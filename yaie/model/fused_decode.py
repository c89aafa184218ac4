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
`fits`: every token a sequence's next one (no prompt or chunk, no speculative verification).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from yaie.model.attention import AttentionMetadata
from yaie.model.linear import DenseLinear, Linear
from yaie.model.quantized_linear import KQuantLinear, QuantizedLinear
from yaie.ops import NativeOps

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


def _covered(layers: list[DecoderLayer]) -> bool:
    """Whether the native op covers every layer."""
    for layer in layers:
        norm, projections = layer.input_layernorm, _projections(layer)
        if layer.self_attn.q_norm is not None or norm.eps != layer.post_attention_layernorm.eps:
            return False
        if all(isinstance(p, (QuantizedLinear, KQuantLinear)) for p in projections):
            # The quantized kernels take float32 activations, in the weight's own input order
            # (GPTQ's act-order permutes it, which only the layer's forward applies).
            if norm.weight.dtype != torch.float32 or any(
                isinstance(p, QuantizedLinear) and p.in_order is not None for p in projections
            ):
                return False
        elif not all(isinstance(p, DenseLinear) and p.packed is not None for p in projections):
            return False
    return True


class FusedDecode:
    """The native decode path of a model whose KV cache is bound; `for_model` says whether it has one."""

    def __init__(self, model: CausalLM, ops: NativeOps) -> None:
        self.model = model
        self.isa_index = ops.isa_index
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
        return cls(model, ops) if _covered(cast("list[DecoderLayer]", list(model.layers))) else None

    def fits(self, meta: AttentionMetadata) -> bool:
        """Whether a step described by `meta` can take the native path."""
        return not meta.prefills and meta.decode_token_idx is None

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
