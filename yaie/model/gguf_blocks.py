"""GGUF's quantized block formats (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) unpacked into values and scales
in row order (quant_layout.Unpacked), ready to be packed for the kernels."""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from yaie.ops.quant_layout import BLOCK, Unpacked


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, as float32 [..., 1]."""
    field: np.ndarray = blocks[..., start : start + 2].copy().view(np.float16).astype(np.float32)
    return field


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 4-bit block order: byte j holds value j (low nibble) and value j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _unpack_q8_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks, 0)
    return Unpacked(blocks[..., 2:].copy().view(np.int8), d[..., 0], None, BLOCK)


def _unpack_q4_0(blocks: np.ndarray) -> Unpacked:
    # d * (q - 8) == d * q + (-8 d) exactly: both products are exact in float32.
    d = _fp16(blocks, 0)
    return Unpacked(_nibbles(blocks[..., 2:]), d[..., 0], -8 * d[..., 0], BLOCK)


def _unpack_q4_1(blocks: np.ndarray) -> Unpacked:
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    return Unpacked(_nibbles(blocks[..., 4:]), d[..., 0], m[..., 0], BLOCK)


def _unpack_q4_k(blocks: np.ndarray) -> Unpacked:
    """256-value super-blocks: d, dmin, eight 6-bit (scale, min) pairs packed in 12 bytes, then
    four 32-byte chunks, each holding 64 values: 32 in the low nibbles, the next 32 in the high."""
    d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
    packed = blocks[..., 4:16]
    lo, hi, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (extra & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (extra >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 32)
    values = np.stack([qs & 0x0F, qs >> 4], axis=-2).reshape(*blocks.shape[:-1], 256)
    return Unpacked(values, d * sc.astype(np.float32), -(dmin * mn.astype(np.float32)), BLOCK)


def _unpack_q6_k(blocks: np.ndarray) -> Unpacked:
    """256-value super-blocks: 4 low bits of each value (128 bytes), 2 high bits (64 bytes),
    sixteen int8 scales (one per 16 values), d. Values are q - 32."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    low = (ql & 0x0F).reshape(*lead, 8, 32)
    high = (qh & 0x03).reshape(*lead, 8, 32)
    values = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8)
    scales = _fp16(blocks, 208) * blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
    return Unpacked(values, scales, None, 16)


_UNPACKERS = {
    GGMLQuantizationType.Q8_0: _unpack_q8_0,
    GGMLQuantizationType.Q4_0: _unpack_q4_0,
    GGMLQuantizationType.Q4_1: _unpack_q4_1,
    GGMLQuantizationType.Q4_K: _unpack_q4_k,
    GGMLQuantizationType.Q6_K: _unpack_q6_k,
}
SUPPORTED_GGML_TYPES = tuple(_UNPACKERS)


def unpack_gguf(data: bytes | np.ndarray, ggml_type: GGMLQuantizationType | int, out_features: int,
                in_features: int) -> Unpacked:
    """A GGUF tensor's raw blocks (as GGUFReader's `tensor.data` or bytes) -> values and scales."""
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in _UNPACKERS:
        names = ", ".join(t.name for t in SUPPORTED_GGML_TYPES)
        raise ValueError(f"quantized weights of type {ggml_type.name} are not supported (supported: {names})")
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if in_features % block_size:
        raise ValueError(
            f"{ggml_type.name} packs {block_size} values a block: in_features={in_features} is not a multiple"
        )
    raw = np.frombuffer(data, np.uint8) if isinstance(data, bytes) else np.asarray(data).view(np.uint8)
    expected = out_features * in_features // block_size * type_size
    if raw.size != expected:
        shape = f"[{out_features}, {in_features}]"
        raise ValueError(f"{ggml_type.name} {shape} takes {expected} bytes, got {raw.size}")
    u = _UNPACKERS[ggml_type](raw.reshape(out_features, in_features // block_size, type_size))
    mins = None if u.mins is None else u.mins.reshape(out_features, -1)
    return Unpacked(u.values.reshape(out_features, -1), u.scales.reshape(out_features, -1), mins, u.block)
