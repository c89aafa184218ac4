"""What an op backend does: every op the model runs, with the semantics each implementation keeps.

Two backends implement it (yaie/ops/torch_ops.py, yaie/ops/native_ops.py); one is chosen when the
model is loaded (yaie/ops/__init__.py: select_ops) and the model's modules call it, never asking
again which one it is. Where an op writes in place, it does so in every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Ops(ABC):
    name: str  # as the load log says it: "torch", "native (avx512vnni)"
    quant_isa: str  # the quantized-matmul kernels' ISA path; "none" where weights are dequantized per call

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """residual += x, in place; returns rms_norm(residual, weight, eps). All [tokens, hidden]."""

    @abstractmethod
    def apply_rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate x [tokens, heads, head_dim] in place by its tokens' rows of the rope tables
        (cos, sin [tokens, 1, head_dim], RotaryEmbedding's): x = x * cos + swap_halves(x) * sin."""

    @abstractmethod
    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """Copy each token's k and v heads [tokens, kv_heads, head_dim] into its cache slot
        (caches [blocks, block_size, kv_heads, head_dim]), rounded to the caches' dtype."""

    @abstractmethod
    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        """One query token per sequence over its first context_lens keys in the paged cache,
        softmax scale head_dim^-0.5: q [seqs, heads, head_dim] -> the same shape, in q's dtype.
        block_tables [seqs, max_blocks] and context_lens [seqs] are int64; the caches may hold
        another float dtype than q (the maths is in q's dtype or wider)."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = [gate | up] [tokens, 2 * inter] -> [tokens, inter], to
        within an ulp of PyTorch's silu: only for a consumer that rounds its input far coarser
        (QuantizedLinear.silu_mul_forward; csrc/activation.cpp says why)."""

    @abstractmethod
    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """logits.argmax(dim=-1) of [rows, vocab]: the first of equal maxima, the first NaN."""

    @abstractmethod
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
        """x [..., in] @ W^T (+ bias) -> [..., out_features] in x's dtype, computed in float32,
        W packed as yaie/ops/quant_layout.py lays it out, its columns holding the input features
        in `in_order` (None: their own order)."""

    @abstractmethod
    def quantized_embedding(
        self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor
    ) -> torch.Tensor:
        """Rows `ids` [tokens] of a packed table, dequantized: float32 [tokens, dim]."""

    @abstractmethod
    def kquant_linear(
        self, x: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """x [..., in] @ W^T (+ bias) -> [..., out_features] in x's dtype, computed in float32, W
        the K-quant `parts` (yaie/ops/kquant_layout.py) stacked by rows."""

    @abstractmethod
    def kquant_embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` [tokens] of a K-quant table, dequantized: float32 [tokens, dim]."""
