"""Linear layers made quantized at load (EngineConfig.quantization), and what they cost.

  none        every weight dequantized to --dtype: exact transformers parity.
  auto        a GGUF file's linear layers (qkv, o, gate_up, down, the LM head) run in the block
              formats the file stores them in; an AWQ or GPTQ checkpoint's in int4, as stored
              (yaie/model/int4_checkpoints.py); a dense checkpoint runs in --dtype.
  int8, int4  a dense checkpoint's linear layers quantized at load, a scale (and a min) per 32.

A quantized embedding table stays quantized too: lookups dequantize only their tokens' rows,
and a tied LM head multiplies by the same table. The layers themselves are in
yaie/model/quantized_linear.py, the packed layout they hold in yaie/ops/quant_layout.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import numpy as np
import torch
from torch import nn

from yaie.model.linear import ConcatLinear, DenseLinear, Linear
from yaie.model.llama import CausalLM
from yaie.model.quantized_linear import KQuantLinear, QuantizedLinear
from yaie.ops.quant_layout import Unpacked

GROUP_SIZE = 32  # values per scale of int8 / int4 at load: the kernels' block


def fuse(shards: list[Unpacked]) -> Unpacked:
    """The shards of a fused projection (q, k, v; gate, up) stacked by rows, in one packed layout.
    Shards of one layout stack as they are. Where layouts differ (Q5_1 q and k beside a Q8_0 v,
    as files of models whose rows are no multiple of 256 mix them), the narrower ones widen to
    the widest (Unpacked.widened): every weight is unchanged and the projection stays one layer,
    at the cost of the widened shards' extra bits."""
    layouts = {(u.bits, u.levels) for u in shards}
    if len(layouts) > 1:
        bits = 8 if any(levels for _, levels in layouts) else max(bits for bits, _ in layouts)
        shards = [u.widened(bits) for u in shards]
    if any(u.mins is not None for u in shards):
        shards = [u.with_mins() for u in shards]
    first = shards[0]
    values, scales = np.concatenate([u.values for u in shards]), np.concatenate([u.scales for u in shards])
    mins = None
    if first.mins is not None:
        mins = np.concatenate([np.zeros_like(u.scales) if u.mins is None else u.mins for u in shards])
    return Unpacked(values, scales, mins, first.bits, first.levels)


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def float_bias(linear: DenseLinear) -> torch.Tensor | None:
    """The kernels add the bias in float32."""
    return None if linear.bias is None else linear.bias.detach().float()


def quantize_linears(model: CausalLM, scheme: Literal["int8", "int4"]) -> None:
    """Replace every dense linear layer (the LM head too) by its `scheme` quantization."""
    for name, module in list(model.named_modules()):
        if isinstance(module, DenseLinear):
            try:
                quantized = QuantizedLinear.quantize(
                    module.weight, scheme, GROUP_SIZE, float_bias(module), ops=model.ops
                )
            except ValueError as exc:
                raise ValueError(f"{name} cannot be quantized to {scheme}: {exc}") from exc
            replace_module(model, name, quantized)


def weight_types(model: nn.Module) -> Counter[str]:
    """Linear layers by the type their weights run in: Q4_1, int8, float32, ...; a ConcatLinear
    counts as its parts, each in its own type."""
    return Counter(
        m.weight_type for m in model.modules() if isinstance(m, Linear) and not isinstance(m, ConcatLinear)
    )


def quantized_types(model: nn.Module) -> list[str]:
    """The types of the model's quantized linear layers (a ConcatLinear's parts among them),
    sorted: ["Q4_1", "Q6_K"]; [] if none."""
    return sorted({m.weight_type for m in model.modules() if isinstance(m, (QuantizedLinear, KQuantLinear))})


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold in memory: parameters and saved buffers (quantized blocks
    and scales), and oneDNN's packed copies, which replace their layers' plain weights. A tensor
    two modules share (a tied LM head's table, also the embedding's) counts once."""
    tensors = list(model.state_dict(keep_vars=True).values())  # the modules' own tensor objects
    tensors += [m.packed for m in model.modules() if isinstance(m, DenseLinear) and m.packed is not None]
    unique = {id(t): t for t in tensors}
    return sum(int(t.nbytes) for t in unique.values())
