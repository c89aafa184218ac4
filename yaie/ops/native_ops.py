"""The ops in yaie's native CPU kernels (yaie/ops/kernels.py, csrc/), where they are faster than
PyTorch's: fewer dispatches and passes at decoding's few rows, integer dot products for
quantized weights. What they do not cover (rms_norm alone) stays PyTorch's."""

from __future__ import annotations

import functools

import torch

from yaie.ops import kernels
from yaie.ops.quant_layout import BLOCK, ISAS
from yaie.ops.torch_ops import TorchOps


@functools.cache
def cpu_isas() -> tuple[str, ...]:
    """The quantized kernels' paths this CPU runs, lowest first (scalar always). Only once the
    native kernels are loaded."""
    return tuple(name for i, name in enumerate(ISAS) if kernels.quant_isa_supported(i))


def choose_isa(forced: str | None) -> str:
    """The best path this CPU has, or the one `forced` (YAIE_QUANT_ISA) names."""
    paths = cpu_isas()
    if forced is None:
        return paths[-1]
    if forced not in paths:
        raise ValueError(
            f"YAIE_QUANT_ISA={forced} is not available on this CPU (available: {', '.join(paths)})"
        )
    return forced


class NativeOps(TorchOps):
    """Only for CPU tensors, once `kernels.load()` returned True (select_ops sees to both)."""

    def __init__(self, quant_isa: str) -> None:
        self.quant_isa = quant_isa
        self.isa_index = ISAS.index(quant_isa)  # as the kernels take it
        self.name = f"native ({quant_isa})"

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        return kernels.add_rms_norm(x, residual, weight, eps)

    def apply_rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        kernels.apply_rope_(x, cos, sin)

    def write_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        kernels.write_kv(k, v, slot_mapping, k_cache, v_cache)

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor:
        return kernels.paged_decode_attention(
            q, k_cache, v_cache, block_tables, context_lens, q.shape[-1] ** -0.5
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32:  # the kernel's one dtype
            return super().silu_mul(gate_up)
        return kernels.silu_and_mul(gate_up)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype != torch.float32 or not logits.is_contiguous():  # the kernel's one layout
            return super().argmax(logits)
        return kernels.argmax_rows(logits)

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
        # Decoding calls this ~120 times a token with one row: each op spared here counts. Always
        # the integer kernel, at any row count: its per-row arithmetic never depends on how many
        # rows there are, so prompts and batches get exactly a lone row's results.
        rows = x.reshape(-1, qweight.shape[1] * BLOCK)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if in_order is not None:
            rows = rows.index_select(1, in_order)
        y = kernels.quant_matmul(rows, qweight, scales, mins, bias, out_features, self.isa_index)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def quantized_embedding(
        self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor
    ) -> torch.Tensor:
        return kernels.quant_embedding(qweight, scales, mins, ids)

    def kquant_linear(
        self, x: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        # Always the integer kernel, at any row count: its per-row arithmetic never depends on
        # how many rows there are, so prompts and batches get exactly a lone row's results.
        rows = x.reshape(-1, x.shape[-1])
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        y = kernels.kquant_matmul(rows, parts, bias, out_features, self.isa_index)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def kquant_embedding(self, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return kernels.kquant_embedding(table, ids)
