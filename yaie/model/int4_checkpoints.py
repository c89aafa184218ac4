"""AWQ and GPTQ int4 checkpoints: their packed tensors unpacked into quant_layout.Unpacked.

Both formats quantize a linear layer's weight W [out, in] to 4-bit q with a float16 scale and an
integer zero point per group of `group_size` input channels: W[o, i] = scale * (q - zero). Our
4-bit layout keeps w = scale * q + min per 32 input channels, so min = -scale * zero, exact in
float32 for float16 or bfloat16 scales (an 11-bit significand times a 5-bit integer), and a group
of 64, 128, ... (or -1: the whole row) repeats its scale and min per 32. Any zero fits, so
symmetric and asymmetric checkpoints load alike. Both store the transposed weight, input
channels as rows, in int32 words:

AWQ (AutoAWQ's GEMM version): eight output columns to a word, in the order 0 2 4 6 1 3 5 7.

    qweight int32 [in, out / 8]     word (i, c), bits 31 ........................ 0
    qzeros  int32 [groups, out / 8]              | o7 | o5 | o3 | o1 | o6 | o4 | o2 | o0 |
    scales  fp16  [groups, out]                  (o_k = output column 8c + k of row i)
    group of input channel i: i // group_size

GPTQ (AutoGPTQ, GPTQModel): qweight packs eight input channels to a word, in order; qzeros packs
eight output columns to a word, in order; g_idx names each input channel's group.

    qweight int32 [in / 8, out]     word (r, o), bits 31 ........................ 0
                                                 | i7 | i6 | i5 | i4 | i3 | i2 | i1 | i0 |
                                                 (i_k = input channel 8r + k, column o)
    qzeros  int32 [groups, out / 8]              | o7 | o6 | o5 | o4 | o3 | o2 | o1 | o0 |
    scales  fp16  [groups, out]
    g_idx   int32 [in]              group of each input channel

GPTQ's original format ("gptq", v1) stores zero - 1 in qzeros: the zero is the nibble + 1
(1..16); "gptq_v2" stores the zero itself. With `desc_act` GPTQ quantized the input channels in
order of decreasing activation, so g_idx is a permutation of i // group_size and 32 consecutive
channels can span several groups. Sorting the channels by group makes every 32-block one group's:
the layer keeps that order (`in_order`) and takes its activations' features in it, exactly, with
no requantization.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from yaie.ops.quant_layout import BLOCK, Unpacked

BITS = 4
VALUES_PER_WORD = 32 // BITS  # values per int32 word
_SHIFTS = np.arange(VALUES_PER_WORD, dtype=np.uint32) * BITS
# Nibble k of an AWQ word holds output column AWQ_ORDER[k] of its eight; column j sits in
# nibble AWQ_ORDER.index(j).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_AWQ_COLUMNS = np.argsort(AWQ_ORDER)
# GPTQ checkpoint formats and what they add to the stored zeros.
GPTQ_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}
METHODS = ("awq", "gptq")


@dataclass(frozen=True)
class Int4Config:
    """What a checkpoint's `quantization_config` says about its int4 layers."""

    method: str  # "awq" or "gptq"
    group_size: int  # input channels per scale; -1: one group for the whole row
    zero_offset: int  # added to every stored zero (GPTQ v1: 1)

    @property
    def parts(self) -> tuple[str, ...]:
        """The tensors each quantized layer stores, beside its optional dense bias."""
        return ("qweight", "qzeros", "scales") + (("g_idx",) if self.method == "gptq" else ())

    @property
    def name(self) -> str:
        return self.method.upper()

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Int4Config:
        """A config.json's `quantization_config`; ValueError says what we cannot run, and why."""
        method = str(config.get("quant_method", "")).lower()
        if method not in METHODS:
            raise ValueError(
                f"quantization_config.quant_method {config.get('quant_method')!r} is not supported "
                f"(supported: {', '.join(METHODS)}; or a plain fp16 / bf16 / fp32 checkpoint)"
            )
        bits = config.get("bits", config.get("w_bit"))
        if bits != BITS:
            raise ValueError(f"{method.upper()} bits={bits} is not supported: the kernels run 4-bit weights")
        group_size = int(config.get("group_size", config.get("q_group_size", 0)))
        if group_size != -1 and (group_size <= 0 or group_size % BLOCK):
            raise ValueError(
                f"{method.upper()} group_size={group_size} is not supported: the kernels keep a scale and "
                f"a min per {BLOCK} input channels, so a group must be a multiple of {BLOCK} (or -1)"
            )
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"AWQ version {version!r} is not supported: yaie reads the GEMM layout")
            if not config.get("zero_point", True):
                raise ValueError(
                    "AWQ with zero_point=false is not supported: its GEMM packing has no signed values"
                )
            return cls(method, group_size, 0)
        fmt = str(config.get("checkpoint_format", "gptq")).lower()
        if fmt not in GPTQ_ZERO_OFFSETS:
            raise ValueError(
                f"GPTQ checkpoint_format {fmt!r} is not supported (supported: {', '.join(GPTQ_ZERO_OFFSETS)})"
            )
        return cls(method, group_size, GPTQ_ZERO_OFFSETS[fmt])


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their eight nibbles, low first, as a new axis after `axis` (uint8)."""
    w = np.expand_dims(words.view(np.uint32), axis + 1)
    shifts = _SHIFTS.reshape((VALUES_PER_WORD,) + (1,) * (words.ndim - axis - 1))
    return ((w >> shifts) & 0xF).astype(np.uint8)


@dataclass(frozen=True, eq=False)
class Int4Weight:
    """One linear layer's weight as an AWQ or GPTQ checkpoint stores it (see the module
    docstring), scales as float32. Unpacked on demand, layer by layer, so that a whole model's
    weights are never held unpacked at once."""

    qweight: np.ndarray
    qzeros: np.ndarray
    scales: np.ndarray
    g_idx: np.ndarray | None  # GPTQ's, where stored
    config: Int4Config

    @classmethod
    def from_tensors(cls, parts: dict[str, torch.Tensor], config: Int4Config) -> Int4Weight:
        """The layer's tensors by part name (qweight, qzeros, scales, g_idx)."""
        g_idx = parts.get("g_idx")
        return cls(
            parts["qweight"].numpy(),
            parts["qzeros"].numpy(),
            parts["scales"].float().numpy(),
            None if g_idx is None else g_idx.numpy().astype(np.int64),
            config,
        )

    @property
    def shape(self) -> tuple[int, int]:
        """[out_features, in_features], as the dense weight."""
        rows = self.qweight.shape[0] * (VALUES_PER_WORD if self.config.method == "gptq" else 1)
        return int(self.scales.shape[1]), int(rows)

    @property
    def weight_type(self) -> str:
        return self.config.name

    def _groups(self) -> np.ndarray:
        """The group of each input channel, int64 [in]."""
        _, k = self.shape
        name, groups_stored = self.config.name, self.scales.shape[0]
        if self.g_idx is not None:
            if self.g_idx.shape != (k,):
                raise ValueError(f"{name}: g_idx has shape {self.g_idx.shape}, not ({k},)")
            groups = self.g_idx
        else:
            groups = np.arange(k) // (k if self.config.group_size == -1 else self.config.group_size)
        if k % BLOCK:
            raise ValueError(f"{name}: in_features={k} is not a multiple of {BLOCK}, as the kernels need")
        if groups.min(initial=0) < 0 or groups.max(initial=0) >= groups_stored:
            raise ValueError(f"{name}: input channels fall in groups outside the {groups_stored} stored")
        return groups

    def _values_and_zeros(self) -> tuple[np.ndarray, np.ndarray]:
        """(q uint8 [in, out], zeros float32 [groups, out])."""
        out, k = self.shape
        if self.config.method == "awq":
            q = _nibbles(self.qweight, 1)[..., _AWQ_COLUMNS].reshape(k, -1)
            zeros = _nibbles(self.qzeros, 1)[..., _AWQ_COLUMNS].reshape(self.qzeros.shape[0], -1)
        else:
            q = _nibbles(self.qweight, 0).reshape(k, -1)
            zeros = _nibbles(self.qzeros, 1).reshape(self.qzeros.shape[0], -1)
        if q.shape != (k, out) or zeros.shape != self.scales.shape:
            raise ValueError(
                f"{self.config.name} tensors do not agree: qweight {self.qweight.shape}, qzeros "
                f"{self.qzeros.shape}, scales {self.scales.shape}"
            )
        return q, zeros.astype(np.float32) + self.config.zero_offset

    @property
    def in_order(self) -> np.ndarray | None:
        """The input channels in the order the unpacked columns hold them (int64 [in]), or None
        where that is their own order: wherever each 32 consecutive channels share a group."""
        groups = self._groups()
        if _one_group_per_block(groups):
            return None
        order = np.argsort(groups, kind="stable")
        if not _one_group_per_block(groups[order]):
            raise ValueError(
                f"{self.config.name}: g_idx gives a group a number of input channels that is not a "
                f"multiple of {BLOCK}, so no order of the channels gives each {BLOCK}-block one scale "
                "(--quantization none runs it dequantized)"
            )
        return order

    def unpacked(self) -> Unpacked:
        """Values, scales and mins per 32 input channels, [out, in], columns in `in_order`."""
        q, zeros = self._values_and_zeros()
        groups, order = self._groups(), self.in_order
        if order is not None:
            q, groups = q[order], groups[order]
        block_groups = groups[::BLOCK]  # [in / 32]
        scales = self.scales[block_groups].T  # [out, in / 32]
        mins = -(scales * zeros[block_groups].T)
        contiguous = np.ascontiguousarray
        return Unpacked(contiguous(q.T), contiguous(scales), contiguous(mins), 4)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """scale * (q - zero) [out, in], computed in float32 (exact), then cast to `dtype`."""
        q, zeros = self._values_and_zeros()
        groups = self._groups()
        w = self.scales[groups] * (q.astype(np.float32) - zeros[groups])  # [in, out]
        return torch.from_numpy(np.ascontiguousarray(w.T)).to(dtype)


def _one_group_per_block(groups: np.ndarray) -> bool:
    blocks = groups.reshape(-1, BLOCK)
    return bool((blocks == blocks[:, :1]).all())
