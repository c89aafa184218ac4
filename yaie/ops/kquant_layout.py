"""The super-block layout of K-quant weights (Q4_K, Q5_K, Q6_K) that csrc/kquant.h describes:
records of 16 weight rows by 256 values, each the file's bits of those rows rearranged so that one
SIMD register holds 16 rows' consecutive values, one row per 32-bit lane.

`pack_kquant` makes the records from a weight's fields as the file holds them (decoded by
yaie/model/gguf_blocks.py: `kquant_fields`), `dequantize_kquant` reads them back in PyTorch (the
torch op backend's path, and the tests' reference), bit for bit what the `gguf` package computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SUPER = 256  # values per super-block
RECORD_ROWS = 16  # weight rows per record
QS_BYTES = 2048
# Record bytes and high-bit plane bytes per type; the record size is what names a packed tensor's type.
RECORD_BYTES = {"Q4_K": 2368, "Q5_K": 2880, "Q6_K": 3392, "Q3_K": 2432}
_QH_BYTES = {"Q4_K": 0, "Q5_K": 512, "Q6_K": 1024, "Q3_K": 0}
# The types with a signed scale per 16 values and a fixed offset instead of mins:
# w = d * scale * (q - offset).
_OFFSETS = {"Q6_K": 32, "Q3_K": 4}
KQUANT_TYPES = tuple(RECORD_BYTES)


@dataclass
class KQuantFields:
    """One weight's super-blocks as its file stores them, in row order ([N, K / 256, ...]).

    values: uint8 [N, S, 256], the stored integers in value order (0..15, 0..31 or 0..63; Q3_K's
    3-bit values plus 4, 0..7);
    scales: uint8 [N, S, 8] (6-bit, per 32 values) or int8 [N, S, 16] (Q6_K, Q3_K: per 16);
    mins: uint8 [N, S, 8] or None (Q6_K, Q3_K); d, dmin: float16 [N, S] (dmin None for those).
    w = d * scale * q - dmin * min, or d * scale * (q - 32) for Q6_K, d * scale * (q - 4) for Q3_K.
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
    low = q & 0x0F
    qs = (low[:, :, :, :, 0] | (low[:, :, :, :, 1] << 4)).transpose(0, 2, 3, 4, 1, 5)  # [g, s, j, c, i, t]
    parts = [qs.reshape(groups, s, QS_BYTES)]
    high = q >> 4  # [g, i, s, j, half, c, t]
    if f.type_name == "Q5_K":  # bit c + 4 * half of lane i byte t
        shifts = (np.arange(4, dtype=np.uint8)[None, :] + 4 * np.arange(2, dtype=np.uint8)[:, None])
        bits = (high << shifts[:, :, None]).sum(axis=(4, 5), dtype=np.uint8)  # [g, i, s, j, t]
        parts.append(bits.transpose(0, 2, 3, 1, 4).reshape(groups, s, 512))
    elif f.type_name == "Q6_K":  # per run (half): bits 2c, 2c + 1 of lane i byte t
        shifts = 2 * np.arange(4, dtype=np.uint8)
        bits = (high << shifts[:, None]).sum(axis=5, dtype=np.uint8)  # [g, i, s, j, half, t]
        parts.append(bits.transpose(0, 2, 3, 4, 1, 5).reshape(groups, s, 1024))
    per_lane = rows(f.scales).transpose(0, 2, 3, 1)  # [g, s, runs, i]
    parts.append(per_lane.reshape(groups, s, -1).view(np.uint8))
    if f.mins is not None:
        parts.append(rows(f.mins).transpose(0, 2, 3, 1).reshape(groups, s, 128))

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
    qs = p[..., :QS_BYTES].view(groups, s, 8, 4, RECORD_ROWS, 4)  # [g, s, j, c, i, t]
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3)  # [g, s, j, half, c, i, t]
    end = QS_BYTES + _QH_BYTES[type_name]
    if type_name == "Q5_K":
        h = p[..., QS_BYTES:end].view(groups, s, 8, 1, 1, RECORD_ROWS, 4)
        shifts = (torch.arange(4)[None, :] + 4 * torch.arange(2)[:, None]).view(1, 1, 1, 2, 4, 1, 1)
        q = q | (((h >> shifts) & 1) << 4)
    elif type_name == "Q6_K":
        h = p[..., QS_BYTES:end].view(groups, s, 8, 2, 1, RECORD_ROWS, 4)
        q = q | (((h >> (2 * torch.arange(4)).view(1, 1, 1, 1, 4, 1, 1)) & 3) << 4)
    values = q.permute(0, 5, 1, 2, 3, 4, 6).reshape(groups, RECORD_ROWS, s, SUPER).float()  # [g, i, s, n]

    def halves(start: int) -> torch.Tensor:  # 16 float16 [g, s, 16] -> float32 [g, i, s, 1]
        bits = packed[..., start : start + 32].contiguous().view(torch.float16).float()
        return bits.permute(0, 2, 1).unsqueeze(-1)

    if type_name in _OFFSETS:
        sc = packed[..., end : end + 256].contiguous().view(torch.int8).view(groups, s, 16, RECORD_ROWS)
        scale = halves(end + 256) * sc.permute(0, 3, 1, 2).float()  # [g, i, s, 16]
        w = scale.repeat_interleave(16, dim=-1) * (values - _OFFSETS[type_name])
    else:
        sc = p[..., end : end + 128].view(groups, s, 8, RECORD_ROWS).permute(0, 3, 1, 2).float()
        mn = p[..., end + 128 : end + 256].view(groups, s, 8, RECORD_ROWS).permute(0, 3, 1, 2).float()
        scale, minimum = halves(end + 256) * sc, halves(end + 288) * mn  # [g, i, s, 8]
        w = scale.repeat_interleave(32, dim=-1) * values - minimum.repeat_interleave(32, dim=-1)
    return w.reshape(groups * RECORD_ROWS, s * SUPER)
