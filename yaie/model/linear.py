"""Linear layers: what every one keeps (Linear), and the dense one (DenseLinear).

A model is built with DenseLinear projections; the loader replaces those whose weights stay
quantized by QuantizedLinear (yaie/model/quantized_linear.py), and a fused projection whose parts
cannot share one layout (q, k in Q4_K beside v in Q6_K) by a ConcatLinear of a layer per part.
All are a Linear, so the modules that call them never ask which they hold.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x @ W^T (+ bias), W [out_features, in_features], whatever form W is held in."""

    in_features: int
    out_features: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], in x's dtype."""
        raise NotImplementedError

    def silu_mul_forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu(gate) * up) of gate_up = [gate | up] [tokens, 2 * in_features]: the down
        projection of a gated MLP. PyTorch's silu here, which keeps a dense model's results
        exactly transformers'; a layer that rounds its input coarser may take a faster one."""
        gate, up = gate_up.chunk(2, dim=-1)
        y: torch.Tensor = self(F.silu(gate) * up)
        return y

    @property
    def weight_type(self) -> str:
        """The type the weight runs in, for reports: float32, bfloat16, Q4_1, int8, ..."""
        raise NotImplementedError


def _onednn_packs(weight: torch.Tensor) -> bool:
    """fp32 always; bf16 where the CPU has native bf16 dot products (AVX512-BF16, AMX), which
    makes bf16 faster than fp32 in the linears instead of slower."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


class DenseLinear(Linear):
    """A weight in the model's dtype, packed once, after loading, for the CPU's fastest path.

    On these CPUs stock MKL GEMM is several times slower than oneDNN at the few-row shapes of
    decoding (and no faster at prefill shapes; benchmarks/quant_matmul.py measures both), so
    `pack()` reorders fp32 (and, where the CPU supports it, bf16) weights into oneDNN's blocked
    layout and frees the plain copy. Elsewhere (CUDA, fp16) F.linear is used.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))  # filled by the loader
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        if _onednn_packs(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self.weight.data = torch.empty(0)  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            y: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return y
        return F.linear(x, self.weight, self.bias)

    @property
    def weight_type(self) -> str:
        return str(self.weight.dtype if self.packed is None else self.packed.dtype).removeprefix("torch.")


class ConcatLinear(Linear):
    """A fused projection (q, k, v; gate, up) held as consecutive row blocks, each its own
    Linear: y = [part_0(x) | part_1(x) | ...]. The loader makes one where the parts' stored types
    share no packed layout (4-bit beside 8-bit, a K-quant beside another type), so that each keeps
    its own type instead of all being dequantized to one dense weight."""

    def __init__(self, parts: list[Linear]) -> None:
        super().__init__()
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("the parts of a fused projection must take the same input features")
        self.parts = parts
        for i, part in enumerate(parts):
            self.add_module(f"part{i}", part)  # a submodule: in state_dict, pack() and modules()
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)

    @property
    def weight_type(self) -> str:
        """Its parts' types, "+"-joined in row order: Q4_K+Q6_K."""
        return "+".join(p.weight_type for p in self.parts)
