"""The super-block layout of K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) that
csrc/kquant.h describes: records of 16 weight rows by 256 values, each the file's bits of those
rows rearranged so that one SIMD register holds 16 rows' consecutive values, one row per 32-bit lane.

`pack_kquant` makes the records from a weight's fields as the file holds them (decoded by
yaie/model/gguf_blocks.py: `kquant_fields`), `dequantize_kquant` reads them back in PyTorch (the
torch op backend's path, and the tests' reference), bit for bit what the `gguf` package computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from yaie.ops.quant_layout import IQ4_LEVELS

SUPER = 256  # values per super-block
RECORD_ROWS = 16  # weight rows per record
# Record bytes per type; the record size is what names a packed tensor's type.
RECORD_BYTES = {"Q4_K": 2368, "Q5_K": 2880, "Q6_K": 3392, "Q3_K": 1824, "Q2_K": 1344, "IQ4_XS": 2240}
KQUANT_TYPES = tuple(RECORD_BYTES)
# The planes of value bits each type's record starts with, low bits first: 4 (2048 bytes), 2
# (1024) and 1 (512) bits a value.
_PLANES = {
    "Q4_K": (4,), "Q5_K": (4, 1), "Q6_K": (4, 2), "Q3_K": (2, 1), "Q2_K": (2,), "IQ4_XS": (4,),
}  # fmt: skip
_PLANE_BYTES = {4: 2048, 2: 1024, 1: 512}
# The types with a signed scale per 16 values and a fixed offset instead of mins:
# w = d * scale * (q - offset).
_OFFSETS = {"Q6_K": 32, "Q3_K": 4}
_PER16 = ("Q6_K", "Q3_K", "Q2_K")  # a scale per 16 values, else per 32


@dataclass
class KQuantFields:
    """One weight's super-blocks as its file stores them, in row order ([N, K / 256, ...]).

    values: uint8 [N, S, 256], the stored integers in value order (0..3, 0..15, 0..31 or 0..63;
    Q3_K's 3-bit values plus 4, 0..7; IQ4_XS's indices into IQ4_LEVELS);
    scales: uint8 [N, S, 8] (6-bit, per 32 values), int8 [N, S, 8] (IQ4_XS), int8 [N, S, 16]
    (Q6_K, Q3_K: per 16) or uint8 [N, S, 16] (Q2_K, 4-bit);
    mins: uint8 [N, S, 8] or [N, S, 16] (Q2_K), None for the types without; d, dmin: float16
    [N, S] (dmin None for those).
    w = d * scale * q - dmin * min, or d * scale * (q - 32) for Q6_K, d * scale * (q - 4) for Q3_K,
    d * scale * IQ4_LEVELS[q] for IQ4_XS.
    """

    type_name: str
    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    d: np.ndarray
    dmin: np.ndarray | None


def stack_fields(fields: list[KQuantFields]) -> KQuantFields:
    """Weights of one type stacked by rows (q above k), as one weight's fields."""
    first = fields[0]
    assert all(f.type_name == first.type_name for f in fields), "stacked K-quant weights share a type"

    def cat(name: str) -> np.ndarray:
        return np.concatenate([getattr(f, name) for f in fields])

    mins = None if first.mins is None else cat("mins")
    dmin = None if first.dmin is None else cat("dmin")
    return KQuantFields(first.type_name, cat("values"), cat("scales"), mins, cat("d"), dmin)


def pack_kquant(f: KQuantFields) -> torch.Tensor:
    """The fields as records: uint8 [ceil(N / 16), K / 256, record bytes] (csrc/kquant.h)."""
    n, s = f.values.shape[:2]
    groups = -(-n // RECORD_ROWS)
    pad = groups * RECORD_ROWS - n  # padding rows: zero scales, so zero outputs

    def rows(a: np.ndarray) -> np.ndarray:
        """[N, S, ...] -> [groups, 16, S, ...], padded with zero rows."""
        padded: np.ndarray = np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return padded.reshape(groups, RECORD_ROWS, *a.shape[1:])

    q = rows(f.values).reshape(groups, RECORD_ROWS, s, 8, 2, 4, 4)  # [g, i, s, j, half, c, t]
    parts, low = [], 0
    for width in _PLANES[f.type_name]:
        bits = (q >> low) & ((1 << width) - 1)
        low += width
        if width == 4:  # chunk c, lane i byte t: value 4c + t low nibble, 16 + 4c + t high
            nibbles = bits[:, :, :, :, 0] | (bits[:, :, :, :, 1] << 4)  # [g, i, s, j, c, t]
            plane = nibbles.transpose(0, 2, 3, 4, 1, 5)  # [g, s, j, c, i, t]
        elif width == 2:  # per run (half): bits 2c, 2c + 1 of lane i byte t
            shifts = 2 * np.arange(4, dtype=np.uint8)
            packed = (bits << shifts[:, None]).sum(axis=5, dtype=np.uint8)  # [g, i, s, j, half, t]
            plane = packed.transpose(0, 2, 3, 4, 1, 5)  # [g, s, j, half, i, t]
        else:  # bit c + 4 * half of lane i byte t
            shifts = np.arange(4, dtype=np.uint8)[None, :] + 4 * np.arange(2, dtype=np.uint8)[:, None]
            packed = (bits << shifts[:, :, None]).sum(axis=(4, 5), dtype=np.uint8)  # [g, i, s, j, t]
            plane = packed.transpose(0, 2, 3, 1, 4)  # [g, s, j, i, t]
        parts.append(plane.reshape(groups, s, _PLANE_BYTES[width]))

    def per_lane(a: np.ndarray) -> np.ndarray:  # [N, S, runs] -> [groups, S, runs * 16] bytes
        lanes: np.ndarray = rows(a).transpose(0, 2, 3, 1).copy().view(np.uint8)
        return lanes.reshape(groups, s, -1)

    if f.type_name == "Q2_K":  # a scale in the low nibble, a min in the high one, as the file
        assert f.mins is not None
        parts.append(per_lane(f.scales | (f.mins << 4)))
    else:
        parts.append(per_lane(f.scales))
        if f.mins is not None:
            parts.append(per_lane(f.mins))

    def halves(a: np.ndarray) -> np.ndarray:  # float16 [N, S] -> the 16 rows' bytes [groups, S, 32]
        bits: np.ndarray = rows(a.astype(np.float16)).transpose(0, 2, 1).copy().view(np.uint8)
        return bits.reshape(groups, s, 32)

    parts.append(halves(f.d))
    if f.dmin is not None:
        parts.append(halves(f.dmin))
    record = np.concatenate(parts, axis=-1)
    record = np.pad(record, ((0, 0), (0, 0), (0, RECORD_BYTES[f.type_name] - record.shape[-1])))
    return torch.from_numpy(np.ascontiguousarray(record))


def kquant_type(packed: torch.Tensor) -> str:
    """The type of a packed K-quant weight, from its record size."""
    for name, size in RECORD_BYTES.items():
        if packed.shape[-1] == size:
            return name
    raise ValueError(f"no K-quant type has records of {packed.shape[-1]} bytes")


def dequantize_kquant(packed: torch.Tensor) -> torch.Tensor:
    """Records [groups, S, record] -> float32 [groups * 16, S * 256], the padding rows included."""
    type_name = kquant_type(packed)
    groups, s, _ = packed.shape
    p = packed.to(torch.int32)
    q = torch.zeros(groups, s, 8, 2, 4, RECORD_ROWS, 4, dtype=torch.int32)  # [g, s, j, half, c, i, t]
    start = low = 0
    for width in _PLANES[type_name]:
        plane = p[..., start : start + _PLANE_BYTES[width]]
        start += _PLANE_BYTES[width]
        if width == 4:
            qs = plane.reshape(groups, s, 8, 1, 4, RECORD_ROWS, 4)
            bits = torch.cat([qs & 0x0F, qs >> 4], dim=3)
        elif width == 2:
            h = plane.reshape(groups, s, 8, 2, 1, RECORD_ROWS, 4)
            bits = (h >> (2 * torch.arange(4)).view(1, 1, 1, 1, 4, 1, 1)) & 3
        else:
            h = plane.reshape(groups, s, 8, 1, 1, RECORD_ROWS, 4)
            shifts = (torch.arange(4)[None, :] + 4 * torch.arange(2)[:, None]).view(1, 1, 1, 2, 4, 1, 1)
            bits = (h >> shifts) & 1
        q = q | (bits << low)
        low += width
    values = q.permute(0, 5, 1, 2, 3, 4, 6).reshape(groups, RECORD_ROWS, s, SUPER)  # [g, i, s, n]

    def halves(offset: int) -> torch.Tensor:  # 16 float16 [g, s, 16] -> float32 [g, i, s, 1]
        bits = packed[..., offset : offset + 32].contiguous().view(torch.float16).float()
        return bits.permute(0, 2, 1).unsqueeze(-1)

    def per_lane(offset: int, runs: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """The 16 rows' bytes per run [g, s, runs * 16] -> int32 [g, i, s, runs]."""
        lanes = packed[..., offset : offset + runs * RECORD_ROWS].contiguous().view(dtype)
        return lanes.view(groups, s, runs, RECORD_ROWS).permute(0, 3, 1, 2).to(torch.int32)

    runs = 16 if type_name in _PER16 else 8
    sc = per_lane(start, runs, torch.uint8 if type_name in ("Q4_K", "Q5_K", "Q2_K") else torch.int8)
    d_at = start + (128 if type_name == "IQ4_XS" else 256)
    mins = None
    if type_name == "Q2_K":
        sc, mins = sc & 0x0F, sc >> 4
    elif type_name in ("Q4_K", "Q5_K"):
        mins = per_lane(start + 128, 8)
    # The products in the `gguf` package's order: (d * scale) * q - dmin * min.
    scale = (halves(d_at) * sc.float()).repeat_interleave(SUPER // runs, dim=-1)  # [g, i, s, 256]
    if type_name == "IQ4_XS":
        w = scale * torch.from_numpy(IQ4_LEVELS).float()[values]
    elif mins is None:
        w = scale * (values - _OFFSETS[type_name]).float()
    else:
        minimum = (halves(d_at + 32) * mins.float()).repeat_interleave(SUPER // runs, dim=-1)
        w = scale * values.float() - minimum
    return w.reshape(groups * RECORD_ROWS, s * SUPER)
