"""The packed layout of quantized weights that the quantized-matmul kernels read
(csrc/quant_common.h), and what picks between the kernels.

"Packing" in yaie means one thing: laying a weight out for the kernel that multiplies by it. Here
that is the formats with a scale per 32 values, each kept in its own bits a value: 4-bit codes
(Q4_0, Q4_1, int4; IQ4_NL's indices into its levels), 5-bit codes (Q5_0, Q5_1) or 8-bit values
(Q8_0, int8), with a min per 32 where the format has one (Q4_1, Q5_1, int4), rows in groups of
GROUP_ROWS; for a dense weight it is oneDNN's blocked layout (yaie/model/linear.py). Scales and
mins are kept in float16 where all of a weight's are exactly float16 (every GGUF type stores them
so), else in float32, so every format's dequantized weights are exactly what the `gguf` package
computes, from as many bytes as the file holds.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

BLOCK = 32  # values per scale, in the weights and in the quantized activations
GROUP_ROWS = 4  # weight rows interleaved in the packed layout

# Kernel paths, lowest first; the index is what the kernels take.
# avx512amx: AVX512-VNNI, and AMX tile multiplies where a kernel has them (the K-quants').
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni", "avx512amx")

# IQ4_NL's and IQ4_XS's sixteen levels (ggml's kvalues_iq4nl), which their 4-bit codes index:
# not evenly spaced, so no scale and min reproduce them.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)

# Bytes of one group's 32-value block, by bits a value: 4-bit codes two rows a byte; 5-bit ones
# the same and then each row's fifth bits, 4 bytes; 8-bit values one a byte.
BLOCK_BYTES = {4: 64, 5: 80, 8: 128}


@dataclass
class Unpacked:
    """One weight's values and scales in row order, before packing.

    values: uint8 [N, K] codes of `bits` bits (4 or 5), or int8 [N, K] values (bits 8);
    scales: float32 [N, K / 32]; mins: float32 [N, K / 32] or None. A weight is
    w = scale * q + min where it has mins (Q4_1, Q5_1, int4; 8-bit values where quantization.fuse
    widened codes); without: w = scale * (q - 8) for 4-bit codes (Q4_0), scale * (q - 16) for
    5-bit ones (Q5_0), scale * IQ4_LEVELS[q] where `levels` (IQ4_NL), scale * q for 8-bit values
    (Q8_0, int8).
    """

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    bits: int
    levels: bool = False

    def with_mins(self) -> Unpacked:
        """The same weight with its mins stored: a centred code's offset becomes the min
        -offset * scale (exact in float32), so it packs beside weights that have mins. Values
        without an offset (8-bit ones, IQ4_NL's levels) keep no mins: they pack with zero ones."""
        if self.mins is not None or self.bits == 8 or self.levels:
            return self
        offset = 1 << (self.bits - 1)
        return Unpacked(self.values, self.scales, -offset * self.scales, self.bits)

    def widened(self, bits: int) -> Unpacked:
        """The same weight in a layout of `bits` (5 or 8) bits a value, to pack beside wider
        shards: 4-bit codes are 5-bit ones; codes as int8 values keep their offset as a min;
        IQ4_NL's codes become their int8 levels."""
        if bits == self.bits:
            return self
        if bits == 5:
            return replace(self.with_mins(), bits=5)
        if self.levels:
            return Unpacked(IQ4_LEVELS[self.values], self.scales, None, 8)
        u = self.with_mins()
        return Unpacked(u.values.astype(np.int8), u.scales, u.mins, 8)


def pack_weight(unpacked: Unpacked) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values and scales in row order -> the kernels' layout (csrc/quant_common.h):
    (qweight [groups, K/32, BLOCK_BYTES[bits]], scales [groups, K/32, 4], mins like the scales or
    None); qweight uint8, except int8 for 8-bit values and for IQ4_NL's codes (they index signed
    levels); scales and mins in float16 where that is exact, else float32."""
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

    if unpacked.bits == 8:
        qweight = grouped(unpacked.values, BLOCK).reshape(groups, blocks, 128)
    else:  # rows 2p and 2p+1 share bytes, low and high nibble
        v = grouped(unpacked.values, BLOCK)
        low = v & 0x0F
        qweight = (low[:, :, 0::2] | (low[:, :, 1::2] << 4)).reshape(groups, blocks, 64)
        if unpacked.bits == 5:  # then each row's fifth bits: bit i of its little-endian uint32 is value i's
            fifth = np.packbits((v >> 4) & 1, axis=-1, bitorder="little").reshape(groups, blocks, 16)
            qweight = np.concatenate([qweight, fifth], axis=-1)
        if unpacked.levels:
            qweight = qweight.view(np.int8)
    scales_t = per_block(unpacked.scales)
    mins = None if unpacked.mins is None else per_block(unpacked.mins)
    if _exact_in_float16(scales_t) and (mins is None or _exact_in_float16(mins)):
        # A one-row matmul is bound by reading memory: a 4-bit weight is then 4.5 bits a value, not 5.
        scales_t, mins = scales_t.half(), None if mins is None else mins.half()
    return torch.from_numpy(np.ascontiguousarray(qweight)), scales_t, mins


def _exact_in_float16(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def packed_bits(qweight: torch.Tensor) -> int:
    """Bits a value of a packed weight, from its block's bytes (BLOCK_BYTES)."""
    return {size: bits for bits, size in BLOCK_BYTES.items()}[qweight.shape[-1]]


def dequantize_groups(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, index: torch.Tensor | None = None
) -> torch.Tensor:
    """Packed weight groups as float32 [groups, GROUP_ROWS, K]: every group, or the ones at `index`."""
    if index is not None:
        qweight, scales = qweight[index], scales[index]
        mins = None if mins is None else mins[index]
    groups, blocks, _ = qweight.shape
    bits = packed_bits(qweight)
    if bits == 8:
        q = qweight.view(groups, blocks, GROUP_ROWS, BLOCK).float()
    else:
        codes = qweight.view(torch.uint8)
        pairs = codes[..., :64].reshape(groups, blocks, 2, 1, BLOCK)
        c = torch.cat([pairs & 0x0F, pairs >> 4], dim=3).view(groups, blocks, GROUP_ROWS, BLOCK)
        if bits == 5:
            fifth = codes[..., 64:].reshape(groups, blocks, GROUP_ROWS, 4, 1)
            shifts = torch.arange(8, dtype=torch.uint8)
            c = c | (((fifth >> shifts) & 1) << 4).reshape(groups, blocks, GROUP_ROWS, BLOCK)
        if qweight.dtype == torch.int8:  # IQ4_NL's codes
            q = torch.from_numpy(IQ4_LEVELS.astype(np.float32))[c.long()]
        elif mins is None:  # centred codes: Q4_0's q - 8, Q5_0's q - 16
            q = c.float() - (1 << (bits - 1))
        else:
            q = c.float()
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
