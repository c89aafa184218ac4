"""Linear layers and embedding tables whose weights stay quantized: GGUF blocks as stored (the
types yaie/model/gguf_blocks.py decodes), AWQ / GPTQ int4 as stored, or int8 / int4 quantized
from a dense weight at load (yaie/model/quantization.py says which runs when).

GGUF's K-quants keep their super-blocks (KQuantLinear, yaie/ops/kquant_layout.py); every other
format is packed once into one of the kernels' two layouts (QuantizedLinear, yaie/ops/quant_layout.py).
The matmul quantizes each activation row to int8 blocks of 32 (llama.cpp's Q8_0 / Q8_1) and takes
integer dot products, in the op backend's ISA path; the torch backend dequantizes the weight at
every call instead: correct, slow.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import nn

from yaie.model.linear import Linear
from yaie.ops import Ops
from yaie.ops.kquant_layout import SUPER, dequantize_kquant, kquant_type
from yaie.ops.quant_layout import BLOCK, Unpacked, dequantize_weight, pack_weight


class QuantizedLinear(Linear):
    """y = x @ W^T (+ bias) with W kept packed in 4 or 8 bits (see the module docstring)."""

    # Buffers, in the layout of csrc/quant_common.h; mins for 4-bit weights, and 8-bit ones with mins (Q5_1).
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None
    in_order: torch.Tensor | None  # int64 [in]: the input feature each packed column takes

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 out_features: int, bias: torch.Tensor | None = None, weight_type: str = "quantized",
                 in_order: torch.Tensor | None = None, *, ops: Ops) -> None:
        """`weight_type` names the format the weight came in (Q4_1, int8, ...), for reports.
        `in_order`: the packed columns hold the input features in this order, not their own
        (GPTQ's act-order, yaie/model/int4_checkpoints.py)."""
        super().__init__()
        self.in_features = qweight.shape[1] * BLOCK
        self.out_features = out_features
        self._weight_type = weight_type
        self.ops = ops
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", bias)
        self.register_buffer("in_order", in_order)

    @classmethod
    def quantize(cls, weight: torch.Tensor, scheme: Literal["int8", "int4"], group_size: int = 32,
                 bias: torch.Tensor | None = None, *, ops: Ops) -> QuantizedLinear:
        """Quantize a dense [out, in] weight: "int8" like Q8_0 (scale = max|w| / 127 per 32);
        "int4" like Q4_1 (scale and min per `group_size`, a multiple of 32: 32 or 128)."""
        n, k = weight.shape
        w = weight.detach().float().numpy()
        if scheme == "int8":
            if k % BLOCK:
                raise ValueError(f"int8 quantizes blocks of {BLOCK}; in_features={k} is not a multiple")
            blocks = w.reshape(n, k // BLOCK, BLOCK)
            scale = np.abs(blocks).max(axis=-1) / 127
            q = np.round(blocks / np.where(scale > 0, scale, 1)[..., None])
            unpacked = Unpacked(q.astype(np.int8).reshape(n, k), scale, None, 8)
        elif scheme == "int4":
            if group_size % BLOCK or k % group_size:
                raise ValueError(f"int4 group_size must be a multiple of {BLOCK} dividing in_features={k}")
            groups = w.reshape(n, k // group_size, group_size)
            low, high = groups.min(axis=-1), groups.max(axis=-1)
            scale = (high - low) / 15
            q = np.clip(np.round((groups - low[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, 15)
            # The kernels scale every 32 values: a larger group repeats its scale and min.
            repeat = group_size // BLOCK
            unpacked = Unpacked(q.astype(np.uint8).reshape(n, k), scale.repeat(repeat, axis=-1),
                                low.repeat(repeat, axis=-1), 4)
        else:
            raise ValueError(f"unknown quantization {scheme!r} (supported: int8, int4)")
        return cls(*pack_weight(unpacked), n, bias, scheme, ops=ops)

    @property
    def weight_type(self) -> str:
        return self._weight_type

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out_features, in_features]."""
        return dequantize_weight(self.qweight, self.scales, self.mins, self.out_features, self.in_order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], computed in float32, returned in x's dtype."""
        return self.ops.quantized_linear(
            x, self.qweight, self.scales, self.mins, self.bias, self.in_order, self.out_features
        )

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The backend's silu * up, which may be an ulp from PyTorch's: this layer rounds its input
        to 8 bits first (csrc/activation.cpp)."""
        y: torch.Tensor = self(self.ops.silu_mul(gate_up))
        return y


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up in a quantized table: each step dequantizes only the rows of
    its tokens. A tied LM head's table serves both (`from_linear` shares its tensors), so a GGUF
    file's embedding is held once, in its stored type, instead of also as a dense copy."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 dtype: torch.dtype, *, ops: Ops) -> None:
        """The table's tensors in QuantizedLinear's layout; lookups return `dtype`, the model's."""
        super().__init__()
        self.dtype = dtype
        self.ops = ops
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def from_linear(cls, linear: QuantizedLinear, dtype: torch.dtype) -> QuantizedEmbedding:
        """Look up in `linear`'s weight rows, sharing (not copying) its tensors."""
        if linear.in_order is not None:
            raise ValueError("a weight with permuted input features cannot serve as an embedding table")
        return cls(linear.qweight, linear.scales, linear.mins, dtype, ops=linear.ops)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens] ids -> [tokens, dim] in the model's dtype."""
        return self.ops.quantized_embedding(self.qweight, self.scales, self.mins, ids).to(self.dtype)


class KQuantLinear(Linear):
    """y = x @ W^T (+ bias) with W in GGUF's K-quant types, kept in their super-blocks
    (yaie/ops/kquant_layout.py): as many bits a value as the file. W may be several parts stacked
    by rows, each its own type (q and k in Q4_K above v in Q6_K): the activation is quantized once
    for all of them. Every part but the last holds whole records (a multiple of 16 rows)."""

    bias: torch.Tensor | None

    def __init__(self, parts: list[torch.Tensor], out_features: int, bias: torch.Tensor | None = None,
                 *, ops: Ops) -> None:
        super().__init__()
        self.in_features = parts[0].shape[1] * SUPER
        self.out_features = out_features
        self.ops = ops
        self.num_parts = len(parts)
        for i, part in enumerate(parts):
            self.register_buffer(f"part{i}", part)
        self.register_buffer("bias", bias)

    @property
    def parts(self) -> list[torch.Tensor]:
        """The packed parts, top rows first: uint8 [groups, K / 256, record bytes] each."""
        return [getattr(self, f"part{i}") for i in range(self.num_parts)]

    @property
    def weight_type(self) -> str:
        """Its parts' types, "+"-joined in row order: Q4_K+Q6_K."""
        return "+".join(kquant_type(p) for p in self.parts)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out_features, in_features]."""
        return torch.cat([dequantize_kquant(p) for p in self.parts])[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], computed in float32, returned in x's dtype."""
        return self.ops.kquant_linear(x, self.parts, self.bias, self.out_features)

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """As QuantizedLinear's: this layer rounds its input to 8 bits first."""
        y: torch.Tensor = self(self.ops.silu_mul(gate_up))
        return y


class KQuantEmbedding(nn.Module):
    """Token embeddings looked up in a K-quant table (QuantizedEmbedding's counterpart): a tied
    LM head's one part serves both, so the table is held once, in its stored type."""

    table: torch.Tensor

    def __init__(self, table: torch.Tensor, dtype: torch.dtype, *, ops: Ops) -> None:
        super().__init__()
        self.dtype = dtype
        self.ops = ops
        self.register_buffer("table", table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens] ids -> [tokens, dim] in the model's dtype."""
        return self.ops.kquant_embedding(self.table, ids).to(self.dtype)
