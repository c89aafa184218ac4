"""Building blocks shared by every supported architecture."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from yaie.model import kernels
from yaie.model.quant import QuantizedLinear


class Embedding(nn.Module):
    """Token ids -> rows of a dense [vocab, hidden] table (quantized tables: quant.QuantizedEmbedding)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim))  # filled by the loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add a sublayer's output to the residual stream, then normalise: (normed, new residual).
        The native kernel updates `residual` in place; the PyTorch path makes a new tensor."""
        if kernels.available(x.device):
            return kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = x + residual
        return self(residual), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies of rotary embeddings, with the scalings HF configs name."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq.float()
    if scaling["rope_type"] == "linear":
        return (inv_freq / scaling["factor"]).float()
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, blended, scaled).float()


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF layout) with cos/sin precomputed for every position.

    The tables are full width, cos as [cos, cos] and sin as [-sin, sin], so that rotating is
    x * cos + swap_halves(x) * sin: three ops for all heads of q and k together.
    """

    cos: torch.Tensor  # [max_positions, head_dim]
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, [tokens, 1, head_dim]: looked up once per step."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] by the tables RotaryEmbedding returned. The native
    kernel rotates x in place, the PyTorch path returns a new tensor: use the result."""
    cos, sin = cos_sin
    if kernels.available(x.device):
        return kernels.apply_rope_(x, cos, sin)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.addcmul(x * cos, torch.cat((x2, x1), dim=-1), sin)


def _onednn_packs(weight: torch.Tensor) -> bool:
    """fp32 always; bf16 where the CPU has native bf16 dot products (AVX512-BF16, AMX), which
    makes bf16 decoding ~1.6x faster than fp32 in the linears instead of slower."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return weight.dtype == torch.float32


class Linear(nn.Module):
    """y = x @ weight.T (+ bias), with the weight repacked once for the CPU's fastest path.

    On these CPUs stock MKL GEMM is 3-4x slower than oneDNN at the few-row shapes of decoding
    (and no faster at prefill shapes), so after loading, `pack()` reorders fp32 (and, where the
    CPU supports it, bf16) weights into oneDNN's blocked layout and frees the plain copy.
    Elsewhere (CUDA, fp16) F.linear is used.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.packed: torch.Tensor | None = None

    def pack(self) -> None:
        if _onednn_packs(self.weight):
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
            self.weight.data = torch.empty(0)  # the packed copy replaces it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """SwiGLU feed-forward with gate and up projections fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        quantized = isinstance(self.down_proj, QuantizedLinear) and gate_up.dtype == torch.float32
        if quantized and kernels.available(x.device):
            # One native pass instead of silu, a temporary and mul; an ulp from PyTorch's silu,
            # which only a quantized MLP may take (csrc/activation.cpp says why).
            return self.down_proj(kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
