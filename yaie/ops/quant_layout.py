"""The packed layout of quantized weights that the quantized-matmul kernels read
(csrc/quant_common.h), and what picks between the kernels.

"Packing" in yaie means one thing: laying a weight out for the kernel that multiplies by it. Here
that is 4-bit values with a scale and a min per 32 (Q4_0, Q4_1, int4) or 8-bit values with a
scale per 32 (Q8_0, int8, Q5_0, IQ4_NL) and a min per 32 where the format has one (Q5_1),
rows in groups of GROUP_ROWS; for a dense weight it is oneDNN's blocked layout
(yaie/model/linear.py). Scales and mins are kept in float16 where all of a weight's are exactly
float16 (Q4_0, Q4_1, Q5_1 and Q8_0 store them so), else in float32, so every format's dequantized
weights are exactly what the `gguf` package computes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 32  # values per activation block, and per weight block of the 4-bit layout
GROUP_ROWS = 4  # weight rows interleaved in the packed layout

# Kernel paths, lowest first; the index is what the kernels take.
# avx512amx: AVX512-VNNI, and AMX tile multiplies where a kernel has them (the K-quants').
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512amx")

# From how many activation rows, per ISA path, dequantizing tiles of the weight and multiplying
# in fp32 beats the int8 kernel: measured by benchmarks/quant_matmul.py (results in
# benchmarks/results/quant_matmul-*.json). On AVX512-VNNI, whose int8 kernel takes 16 weight rows a
# register from two activation rows on (csrc/quant_avx512.cpp), the int8 kernel wins at every row
# count measured, so never. AVX-VNNI and scalar are unmeasured and keep AVX2's.
DEQUANTIZED_FROM_ROWS = {
    "scalar": 64, "avx2": 64, "avxvnni": 64, "avx512vnni": sys.maxsize, "avx512amx": sys.maxsize,
}  # fmt: skip
# Rows per dequantized tile: 256 x 576 fp32 is 576 KiB, within L2 with the activations' rows.
TILE_ROWS = 256


@dataclass
class Unpacked:
    """One weight's values and scales in row order, before packing: w = scale * q + min.

    values: uint8 [N, K] in 0..15 (4-bit) or int8 [N, K] (8-bit); scales: float32 [N, K / 32];
    mins: float32 [N, K / 32], always for 4-bit weights, for 8-bit ones where the format has them
    (Q5_1), else None.
    """

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None

    @property
    def bits(self) -> int:
        """Which of the two layouts the weight packs into: its values' type says."""
        return 4 if self.values.dtype == np.uint8 else 8


def pack_weight(unpacked: Unpacked) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values and scales in row order -> the kernels' layout (csrc/quant_common.h):
    (qweight [groups, K/32, 64 or 128], scales [groups, K/32, 4], mins [groups, K/32, 4] or None);
    scales and mins in float16 where that is exact, else float32."""
    n, k = unpacked.values.shape
    groups, blocks = -(-n // GROUP_ROWS), k // BLOCK
    pad = groups * GROUP_ROWS - n  # padding rows: zero scales and mins, so zero outputs

    def grouped(a: np.ndarray, per_row: int) -> np.ndarray:
        """[N, blocks * per_row] -> [groups, blocks, 4 rows, per_row]."""
        padded: np.ndarray = np.pad(a, ((0, pad), (0, 0)))
        out: np.ndarray = padded.reshape(groups, GROUP_ROWS, blocks, per_row).transpose(0, 2, 1, 3)
        return out

    def per_block(a: np.ndarray) -> torch.Tensor:
        """Scales or mins [N, blocks] -> float32 [groups, blocks, 4 rows]."""
        out = grouped(a.astype(np.float32), 1).reshape(groups, blocks, GROUP_ROWS)
        return torch.from_numpy(np.ascontiguousarray(out))

    if unpacked.bits == 4:  # rows 2p and 2p+1 share bytes, low and high nibble
        v = grouped(unpacked.values, BLOCK)
        qweight = (v[:, :, 0::2] | (v[:, :, 1::2] << 4)).reshape(groups, blocks, 64)
    else:
        qweight = grouped(unpacked.values, BLOCK).reshape(groups, blocks, 128)
    scales_t = per_block(unpacked.scales)
    mins = None if unpacked.mins is None else per_block(unpacked.mins)
    if _exact_in_float16(scales_t) and (mins is None or _exact_in_float16(mins)):
        # A one-row matmul is bound by reading memory: a 4-bit weight is then 5 bits a value, not 6.
        scales_t, mins = scales_t.half(), None if mins is None else mins.half()
    return torch.from_numpy(np.ascontiguousarray(qweight)), scales_t, mins


def _exact_in_float16(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def dequantize_groups(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed weight groups as float32 [groups, GROUP_ROWS, K]: every group, or the ones at `index`."""
    if index is not None:
        qweight, scales = qweight[index], scales[index]
        mins = None if mins is None else mins[index]
    groups, blocks, _ = qweight.shape
    if qweight.dtype == torch.uint8:  # 4-bit: two rows' values a byte
        pairs = qweight.view(groups, blocks, 2, 1, BLOCK)
        q = torch.cat([pairs & 0x0F, pairs >> 4], dim=3).view(groups, blocks, GROUP_ROWS, BLOCK).float()
    else:
        q = qweight.view(groups, blocks, GROUP_ROWS, BLOCK).float()
    w = q * scales.float()[..., None]
    if mins is not None:
        w = w + mins.float()[..., None]
    return w.permute(0, 2, 1, 3).reshape(groups, GROUP_ROWS, blocks * BLOCK)


def dequantize_weight(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    out_features: int,
    in_order: torch.Tensor | None,
) -> torch.Tensor:
    """A packed weight as float32 [out_features, in_features], its input features in their own
    order (`in_order`: the order the packed columns hold them in, or None where that is theirs)."""
    w = dequantize_groups(qweight, scales, mins).flatten(0, 1)[:out_features]
    return w if in_order is None else w[:, torch.argsort(in_order)]
