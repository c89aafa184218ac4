"""A decoding step through all the decoder layers in one native call (csrc/decode_layer.cpp).

A one-token step makes ~20 Python-level ops per layer between and around its matmuls (norms,
views, rope, the cache write, attention, the activation). With weights kept in 4 or 8 bits they
cost as much as the matmuls; with fp32 weights, a third as much. The native op runs the same
kernels in the same order without them, so it changes the speed of a step, never its result.
The layers' weights and KV caches go to the native side once, in a DecodeStack; a step passes
only what changes (the activations, the rope rows, the attention metadata). A call per layer
cost more in converting its twenty arguments than most of its kernels took: with the bundled
Q4_1 model, about a tenth of one client's step. A FusedDecode is made for one KV cache
(CausalLM.bind_kv_cache makes a new one for another).

It applies when every layer is without q/k norms and has its four projections all
QuantizedLinear (float32 activations) or all oneDNN-packed Linear, to a step in which every token
is a sequence's next one (no prompt or chunk, no speculative verification) with fewer rows than
the quantized matmul's DEQUANTIZED_FROM_ROWS for the ISA path in use; any other step runs the
layers' Python forward.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

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


def _projections_covered(projections: tuple[torch.nn.Module, ...], dtype: torch.dtype) -> bool:
    if all(isinstance(p, QuantizedLinear) for p in projections):
        # The quantized kernels take float32 activations, in the weight's own input order (GPTQ's
        # act-order permutes it, which only the layer's forward applies).
        return dtype == torch.float32 and all(p.in_order is None for p in projections)
    return all(isinstance(p, Linear) and p.packed is not None for p in projections)


def _layer_covered(layer: DecoderLayer) -> bool:
    norm = layer.input_layernorm
    return (
        _projections_covered(_projections(layer), norm.weight.dtype)
        and layer.self_attn.q_norm is None
        and norm.eps == layer.post_attention_layernorm.eps
    )


class FusedDecode:
    """The decode path of a model's stack of DecoderLayers; `for_layers` says whether it has one."""

    def __init__(self, layers: Sequence[DecoderLayer]) -> None:
        self.layers = list(layers)

    @classmethod
    def for_layers(cls, layers: Sequence[DecoderLayer]) -> FusedDecode | None:
        """A FusedDecode if the native op covers every one of `layers`, else None."""
        return cls(layers) if layers and all(_layer_covered(layer) for layer in layers) else None

    def runs(self, x: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step can take the native path."""
        return (
            not meta.prefills
            and meta.decode_token_idx is None
            and kernels.available(x.device)
            and x.shape[0] < quant.DEQUANTIZED_FROM_ROWS[quant.isa()]
        )

    @functools.cached_property
    def _stack(self) -> Any:  # torch.classes.yaie.DecodeStack, made on the first native step
        stack = torch.classes.yaie.DecodeStack()
        for layer in self.layers:
            attn, norm = layer.self_attn, layer.input_layernorm
            qkv, o, gate_up, down = (_projection(p) for p in _projections(layer))
            stack.add_layer(
                norm.weight, layer.post_attention_layernorm.weight, norm.eps, qkv, o, gate_up, down,
                attn.k_cache, attn.v_cache, attn.num_heads, attn.num_kv_heads, layer.mlp.intermediate_size,
            )  # fmt: skip
        return stack

    def __call__(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layers' loop over DecoderLayer.forward, whose contract each layer keeps: x is the
        previous layer's MLP output, which the op adds to `residual` in place. Returns the last
        layer's (MLP output, residual)."""
        cos, sin = rope
        x = torch.ops.yaie.decode_layers(
            x, residual, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
            self._stack, quant.ISAS.index(quant.isa()),
        )  # fmt: skip
        return x, residual
