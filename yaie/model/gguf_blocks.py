"""GGUF's quantized block formats decoded into what the kernels' layouts are packed from.

The types with 256-value super-blocks, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS, come out as
their super-blocks' fields (kquant_layout.KQuantFields), which keep the file's bits a value
(yaie/ops/kquant_layout.py). Every other type has a scale per 32 values and is unpacked into
codes (or values) and scales in row order (quant_layout.Unpacked), in its own bits a value: 4-bit
codes (Q4_0, Q4_1, IQ4_NL), 5-bit ones (Q5_0, Q5_1) or int8 values (Q8_0), with Q4_1's and
Q5_1's mins. Every weight dequantizes to exactly the float32 the `gguf` package computes, the
same product of the same two factors (plus the same min).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from yaie.ops.kquant_layout import KQuantFields
from yaie.ops.quant_layout import Unpacked


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, as float32 [..., 1]."""
    field: np.ndarray = blocks[..., start : start + 2].copy().view(np.float16).astype(np.float32)
    return field


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGML's 4-bit block order: byte j holds value j (low nibble) and value j + 16 (high)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _unpack_q8_0(blocks: np.ndarray) -> Unpacked:
    d = _fp16(blocks, 0)
    return Unpacked(blocks[..., 2:].copy().view(np.int8), d[..., 0], None, 8)


def _unpack_q4_0(blocks: np.ndarray) -> Unpacked:
    """d, then the codes; w = d * (q - 8)."""
    d = _fp16(blocks, 0)
    return Unpacked(_nibbles(blocks[..., 2:]), d[..., 0], None, 4)


def _unpack_q4_1(blocks: np.ndarray) -> Unpacked:
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    return Unpacked(_nibbles(blocks[..., 4:]), d[..., 0], m[..., 0], 4)


def _high_bits(bits: np.ndarray, count: int) -> np.ndarray:
    """Bit i of each byte, for i in 0..count-1, as [..., count, bytes]: Q5's and Q3_K's high
    bits, where value j of a run of 32 (or 8 runs) takes bit (run) of byte j."""
    shifts = np.arange(count, dtype=np.uint8).reshape(count, 1)
    high: np.ndarray = (bits[..., None, :] >> shifts) & 1
    return high


def _five_bits(fields: np.ndarray) -> np.ndarray:
    """The Q5 types' 20 bytes of values -> q in 0..31 (uint8 [..., 32]): 32 high bits (bit j of a
    little-endian uint32 is value j's), then 4-bit values as Q4_0 lays them out."""
    high = np.swapaxes(_high_bits(fields[..., 0:4], 8), -1, -2)  # [..., byte, bit]: value 8 byte + bit
    q: np.ndarray = _nibbles(fields[..., 4:]) | (high.reshape(*fields.shape[:-1], 32) << 4)
    return q


def _unpack_q5_0(blocks: np.ndarray) -> Unpacked:
    """d, then the codes; w = d * (q - 16)."""
    d = _fp16(blocks, 0)
    return Unpacked(_five_bits(blocks[..., 2:]), d[..., 0], None, 5)


def _unpack_q5_1(blocks: np.ndarray) -> Unpacked:
    """d, m, then the codes; w = d * q + m."""
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    return Unpacked(_five_bits(blocks[..., 4:]), d[..., 0], m[..., 0], 5)


def _unpack_iq4_nl(blocks: np.ndarray) -> Unpacked:
    """d, then 4-bit indices into IQ4_LEVELS laid out as Q4_0's codes; w = d * IQ4_LEVELS[q]."""
    d = _fp16(blocks, 0)
    return Unpacked(_nibbles(blocks[..., 2:]), d[..., 0], None, 4, levels=True)


_UNPACKERS = {
    GGMLQuantizationType.Q8_0: _unpack_q8_0,
    GGMLQuantizationType.Q4_0: _unpack_q4_0,
    GGMLQuantizationType.Q4_1: _unpack_q4_1,
    GGMLQuantizationType.Q5_0: _unpack_q5_0,
    GGMLQuantizationType.Q5_1: _unpack_q5_1,
    GGMLQuantizationType.IQ4_NL: _unpack_iq4_nl,
}


def _k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's eight 6-bit (scale, min) pairs, packed in 12 bytes -> uint8 [..., 8] each."""
    lo, hi, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (extra & 0x0F) | ((lo >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([hi & 0x3F, (extra >> 4) | ((hi >> 2) & 0x30)], axis=-1)
    return sc, mn


def _q4_k_fields(blocks: np.ndarray) -> KQuantFields:
    """256-value super-blocks: d, dmin, eight 6-bit (scale, min) pairs packed in 12 bytes, then
    four 32-byte chunks, each holding 64 values: 32 in the low nibbles, the next 32 in the high."""
    sc, mn = _k_scales_mins(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:-1], 4, 1, 32)
    values = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*blocks.shape[:-1], 256)
    return KQuantFields("Q4_K", values, sc, mn, _fp16(blocks, 0)[..., 0], _fp16(blocks, 2)[..., 0])


def _q5_k_fields(blocks: np.ndarray) -> KQuantFields:
    """As Q4_K, with 32 bytes of fifth bits between the scales and the low nibbles: value
    32 r + j takes bit r of byte j."""
    sc, mn = _k_scales_mins(blocks[..., 4:16])
    qs = blocks[..., 48:].reshape(*blocks.shape[:-1], 4, 1, 32)
    low = ((qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(*blocks.shape[:-1], 8, 32)
    values = (low | (_high_bits(blocks[..., 16:48], 8) << 4)).reshape(*blocks.shape[:-1], 256)
    return KQuantFields("Q5_K", values, sc, mn, _fp16(blocks, 0)[..., 0], _fp16(blocks, 2)[..., 0])


def _q6_k_fields(blocks: np.ndarray) -> KQuantFields:
    """256-value super-blocks: 4 low bits of each value (128 bytes), 2 high bits (64 bytes),
    sixteen int8 scales (one per 16 values), d. Values are q - 32, q in 0..63."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    low = (ql & 0x0F).reshape(*lead, 8, 32)
    high = (qh & 0x03).reshape(*lead, 8, 32)
    values = (low | (high << 4)).reshape(*lead, 256)
    scales = blocks[..., 192:208].copy().view(np.int8)
    return KQuantFields("Q6_K", values, scales, None, _fp16(blocks, 208)[..., 0], None)


def _two_bits(qs: np.ndarray) -> np.ndarray:
    """Q2_K's values and Q3_K's low bits: two runs of 128 values, each 4 x 32 at bit shifts 0, 2,
    4, 6 of 32 bytes -> uint8 [..., 8 runs of 32, 32]."""
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    low: np.ndarray = (qs.reshape(*qs.shape[:-1], 2, 1, 32) >> shifts) & 3  # [..., 2, 4, 32]
    return low.reshape(*qs.shape[:-1], 8, 32)


def _q3_k_fields(blocks: np.ndarray) -> KQuantFields:
    """256-value super-blocks: a high-bit mask (32 bytes: value 32 r + j takes bit r of byte j),
    2 low bits of each value (64 bytes, as _two_bits reads them), sixteen 6-bit scales packed in
    12 bytes, d. w = d * (6-bit - 32) * q, q = low - 4 where the high bit is clear: stored as
    q + 4 = low + 4 * high, 0..7, with the scales signed."""
    lead = blocks.shape[:-1]
    high = _high_bits(blocks[..., 0:32], 8)  # [..., 8 runs, 32]
    values = (_two_bits(blocks[..., 32:96]) | (high << 2)).reshape(*lead, 256)
    packed = blocks[..., 96:108]
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    nibbles = np.stack([packed[..., 0:8] & 0x0F, packed[..., 0:8] >> 4], axis=-2).reshape(*lead, 16)
    twos = (packed[..., 8:12].reshape(*lead, 1, 4) >> shifts) & 3  # [..., 4 shifts, 4 bytes]
    scales = ((nibbles | (twos.reshape(*lead, 16) << 4)).astype(np.int16) - 32).astype(np.int8)
    return KQuantFields("Q3_K", values, scales, None, _fp16(blocks, 108)[..., 0], None)


def _q2_k_fields(blocks: np.ndarray) -> KQuantFields:
    """256-value super-blocks: sixteen bytes of a 4-bit scale (low nibble) and a 4-bit min (high)
    per 16 values, 2 bits of each value (as _two_bits reads them), d, dmin."""
    values = _two_bits(blocks[..., 16:80]).reshape(*blocks.shape[:-1], 256)
    packed = blocks[..., 0:16]
    d, dmin = _fp16(blocks, 80)[..., 0], _fp16(blocks, 82)[..., 0]
    return KQuantFields("Q2_K", values, packed & 0x0F, packed >> 4, d, dmin)


def _iq4_xs_fields(blocks: np.ndarray) -> KQuantFields:
    """256-value super-blocks: d, the 2 high bits of eight 6-bit scales (a uint16), their 4 low
    bits (4 bytes), then eight runs of 16 bytes of 4-bit indices into IQ4_LEVELS laid out as
    Q4_0's values. w = d * (scale - 32) * level."""
    lead = blocks.shape[:-1]
    high = blocks[..., 2:4].copy().view(np.uint16) >> (2 * np.arange(8, dtype=np.uint16))
    low = np.stack([blocks[..., 4:8] & 0x0F, blocks[..., 4:8] >> 4], axis=-1).reshape(*lead, 8)
    scales = ((low | ((high & 0x03).astype(np.uint8) << 4)).astype(np.int16) - 32).astype(np.int8)
    values = _nibbles(blocks[..., 8:].reshape(*lead, 8, 16)).reshape(*lead, 256)
    return KQuantFields("IQ4_XS", values, scales, None, _fp16(blocks, 0)[..., 0], None)


_KQUANT_FIELDS = {
    GGMLQuantizationType.Q4_K: _q4_k_fields,
    GGMLQuantizationType.Q5_K: _q5_k_fields,
    GGMLQuantizationType.Q6_K: _q6_k_fields,
    GGMLQuantizationType.Q3_K: _q3_k_fields,
    GGMLQuantizationType.Q2_K: _q2_k_fields,
    GGMLQuantizationType.IQ4_XS: _iq4_xs_fields,
}
SUPPORTED_GGML_TYPES = tuple(_UNPACKERS) + tuple(_KQUANT_FIELDS)
KQUANT_GGML_TYPES = tuple(_KQUANT_FIELDS)


def _blocks(data: bytes | np.ndarray, ggml_type: GGMLQuantizationType, out_features: int,
            in_features: int) -> np.ndarray:
    """A tensor's raw bytes as [out_features, blocks per row, bytes per block], checked."""
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
    return raw.reshape(out_features, in_features // block_size, type_size)


def kquant_fields(data: bytes | np.ndarray, ggml_type: GGMLQuantizationType | int, out_features: int,
                  in_features: int) -> KQuantFields:
    """A K-quant tensor's raw blocks -> its fields in row order, for yaie/ops/kquant_layout.py."""
    ggml_type = GGMLQuantizationType(ggml_type)
    return _KQUANT_FIELDS[ggml_type](_blocks(data, ggml_type, out_features, in_features))


def unpack_gguf(data: bytes | np.ndarray, ggml_type: GGMLQuantizationType | int, out_features: int,
                in_features: int) -> Unpacked:
    """A GGUF tensor's raw blocks (as GGUFReader's `tensor.data` or bytes) -> values and scales."""
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in _UNPACKERS:
        if ggml_type in _KQUANT_FIELDS:
            raise ValueError(f"{ggml_type.name} keeps its super-blocks: read it with kquant_fields")
        names = ", ".join(t.name for t in SUPPORTED_GGML_TYPES)
        raise ValueError(f"quantized weights of type {ggml_type.name} are not supported (supported: {names})")
    u = _UNPACKERS[ggml_type](_blocks(data, ggml_type, out_features, in_features))
    mins = None if u.mins is None else u.mins.reshape(out_features, -1)
    values, scales = u.values.reshape(out_features, -1), u.scales.reshape(out_features, -1)
    return Unpacked(values, scales, mins, u.bits, u.levels)
