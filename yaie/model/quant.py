"""Linear layers whose weights stay quantized: GGUF Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K as stored,
or int8 / int4 quantized from a dense weight at load.

Every format is repacked once, here, into one of the two layouts the native kernels stream
(csrc/quant_common.h): 4-bit values with a scale and a min per 32 (Q4_0, Q4_1, Q4_K, int4) or
8-bit values with a scale per 32 or per 16 (Q8_0, int8; Q6_K). Scales and mins are kept in
float16 where all of a weight's are exactly float16 (Q4_0, Q4_1 and Q8_0 store them so), else
in float32, so every format's dequantized weights are exactly what the `gguf` package computes.

The matmul quantizes each activation row to int8 blocks of 32 (llama.cpp's Q8_0 / Q8_1) and
takes integer dot products, in the best ISA path this CPU has (`isa()`; YAIE_QUANT_ISA forces a
lower one). Without the native kernels the weights are dequantized at every call: correct, slow.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from yaie.model import kernels

BLOCK = 32  # values per activation block, and per weight block of the 4-bit layout
GROUP_ROWS = 4  # weight rows interleaved in the packed layout

# Kernel paths, lowest first; the index is what the kernels take.
ISAS = ("scalar", "avx2", "avxvnni", "avx512vnni")

# From how many activation rows, per ISA path, dequantizing tiles of the weight and multiplying
# in fp32 beats the int8 kernel (benchmarks/quant_matmul.py). AVX2 (1 thread, a busy shared
# machine): up to 32 rows int8 is 1.1-1.4x faster than the tiles at every shape; at 512 the tiles
# are 1.1-2x faster at qkv, down and o_proj, even at gate_up, and 0.8x at lm_head; 64-128 is
# mixed. AVX512-VNNI (2 threads), whose int8 kernel takes 16 weight rows a register from two
# activation rows on (csrc/quant_avx512.cpp): int8 1.7-2.3x faster than the tiles at 512 rows at
# every shape, more at fewer, so never. AVX-VNNI and scalar are unmeasured and keep AVX2's.
DEQUANTIZED_FROM_ROWS = {"scalar": 64, "avx2": 64, "avxvnni": 64, "avx512vnni": sys.maxsize}
# Rows per dequantized tile: 256 x 576 fp32 is 576 KiB, within L2 with the activations' rows.
TILE_ROWS = 256


@dataclass
class Unpacked:
    """One weight's values and scales in row order, before packing: w = scale * q + min.

    values: uint8 [N, K] in 0..15 (4-bit) or int8 [N, K]; scales: float32 [N, K / block];
    mins: float32 [N, K / 32] for 4-bit weights, else None.
    """

    values: np.ndarray
    scales: np.ndarray
    mins: np.ndarray | None
    block: int


def _fp16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 field at byte `start` of every block, as float32 [..., 1]."""
    return blocks[..., start : start + 2].copy().view(np.float16).astype(np.float32)


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


def pack(unpacked: Unpacked) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Values and scales in row order -> the kernels' layout (csrc/quant_common.h):
    (qweight [groups, K/32, 64 or 128], scales [groups, K/32, 4 or 8], mins [groups, K/32, 4]);
    scales and mins in float16 where that is exact, else float32."""
    n, k = unpacked.values.shape
    groups, blocks = -(-n // GROUP_ROWS), k // BLOCK
    pad = groups * GROUP_ROWS - n  # padding rows: zero scales and mins, so zero outputs

    def grouped(a: np.ndarray, per_row: int) -> np.ndarray:
        """[N, blocks * per_row] -> [groups, blocks, 4 rows, per_row]."""
        a = np.pad(a, ((0, pad), (0, 0)))
        return a.reshape(groups, GROUP_ROWS, blocks, per_row).transpose(0, 2, 1, 3)

    if unpacked.mins is not None:  # 4-bit: rows 2p and 2p+1 share bytes, low and high nibble
        v = grouped(unpacked.values, BLOCK)
        qweight = (v[:, :, 0::2] | (v[:, :, 1::2] << 4)).reshape(groups, blocks, 64)
        mins = torch.from_numpy(np.ascontiguousarray(grouped(unpacked.mins, 1).reshape(groups, blocks, 4)))
    else:
        qweight = grouped(unpacked.values, BLOCK).reshape(groups, blocks, 128)
        mins = None
    per_block = BLOCK // unpacked.block
    # Scales per 16 go as the four rows' first halves, then their second halves.
    scales = grouped(unpacked.scales.astype(np.float32), per_block).transpose(0, 1, 3, 2)
    scales_t = torch.from_numpy(np.ascontiguousarray(scales.reshape(groups, blocks, 4 * per_block)))
    if _exact_in_float16(scales_t) and (mins is None or _exact_in_float16(mins)):
        # A one-row matmul is bound by reading memory: a 4-bit weight is then 5 bits a value, not 6.
        scales_t, mins = scales_t.half(), None if mins is None else mins.half()
    return torch.from_numpy(np.ascontiguousarray(qweight)), scales_t, mins


def _exact_in_float16(values: torch.Tensor) -> bool:
    return bool(torch.equal(values.half().float(), values))


def available_isas() -> tuple[str, ...]:
    """The kernel paths this CPU runs (scalar always), lowest first; () without native kernels."""
    return _cpu_isas() if kernels.available(torch.device("cpu")) else ()


@functools.cache
def _cpu_isas() -> tuple[str, ...]:
    return tuple(name for i, name in enumerate(ISAS) if torch.ops.yaie.quant_isa_supported(i))


def isa() -> str:
    """The kernel path in use: the best this CPU has, or the one YAIE_QUANT_ISA names."""
    return _resolve_isa(available_isas(), os.environ.get("YAIE_QUANT_ISA"))


@functools.cache
def _resolve_isa(paths: tuple[str, ...], forced: str | None) -> str:
    # Cached: every matmul asks, and the answer changes only with its arguments.
    if not paths:
        return "none"
    if forced is None:
        return paths[-1]
    if forced not in paths:
        available = ", ".join(paths)
        raise ValueError(f"YAIE_QUANT_ISA={forced} is not available on this CPU (available: {available})")
    return forced


class QuantizedLinear(nn.Module):
    """y = x @ W.T (+ bias) with W kept packed in 4 or 8 bits (see the module docstring)."""

    # Buffers, in the layout of csrc/quant_common.h; mins only for 4-bit weights.
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bias: torch.Tensor | None
    in_order: torch.Tensor | None  # int64 [in]: the input feature each packed column takes

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 out_features: int, bias: torch.Tensor | None = None, weight_type: str = "quantized",
                 in_order: torch.Tensor | None = None) -> None:
        """`weight_type` names the format the weight came in (Q4_1, int8, ...), for reports.
        `in_order`: the packed columns hold the input features in this order, not their own
        (GPTQ's act-order, yaie/model/int4_checkpoints.py)."""
        super().__init__()
        self.in_features = qweight.shape[1] * BLOCK
        self.out_features = out_features
        self.weight_type = weight_type
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)
        self.register_buffer("bias", bias)
        self.register_buffer("in_order", in_order)

    @classmethod
    def from_gguf(cls, data: bytes | np.ndarray, ggml_type: GGMLQuantizationType | int, out_features: int,
                  in_features: int, bias: torch.Tensor | None = None) -> QuantizedLinear:
        """A GGUF tensor's raw blocks, [out_features, in_features] in GGUF's own block format."""
        unpacked = unpack_gguf(data, ggml_type, out_features, in_features)
        return cls(*pack(unpacked), out_features, bias, GGMLQuantizationType(ggml_type).name)

    @classmethod
    def quantize(cls, weight: torch.Tensor, scheme: Literal["int8", "int4"], group_size: int = 32,
                 bias: torch.Tensor | None = None) -> QuantizedLinear:
        """Quantize a dense [out, in] weight: "int8" like Q8_0 (scale = max|w| / 127 per 32);
        "int4" like Q4_1 (scale and min per `group_size`, a multiple of 32: 32 or 128)."""
        n, k = weight.shape
        w = weight.detach().float().numpy()
        if scheme == "int8":
            if k % BLOCK:
                raise ValueError(f"int8 quantizes blocks of {BLOCK}; in_features={k} is not a multiple")
            blocks = w.reshape(n, k // BLOCK, BLOCK)
            scale = np.abs(blocks).max(axis=-1) / 127
            q = np.round(blocks / np.where(scale > 0, scale, 1)[..., None])
            unpacked = Unpacked(q.astype(np.int8).reshape(n, k), scale, None, BLOCK)
        elif scheme == "int4":
            if group_size % BLOCK or k % group_size:
                raise ValueError(f"int4 group_size must be a multiple of {BLOCK} dividing in_features={k}")
            groups = w.reshape(n, k // group_size, group_size)
            low, high = groups.min(axis=-1), groups.max(axis=-1)
            scale = (high - low) / 15
            q = np.clip(np.round((groups - low[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, 15)
            # The kernels scale every 32 values: a larger group repeats its scale and min.
            repeat = group_size // BLOCK
            unpacked = Unpacked(q.astype(np.uint8).reshape(n, k), scale.repeat(repeat, axis=-1),
                                low.repeat(repeat, axis=-1), BLOCK)
        else:
            raise ValueError(f"unknown quantization {scheme!r} (supported: int8, int4)")
        return cls(*pack(unpacked), n, bias, scheme)

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [out_features, in_features]."""
        w = dequantize_groups(self.qweight, self.scales, self.mins).flatten(0, 1)[: self.out_features]
        return w if self.in_order is None else w[:, torch.argsort(self.in_order)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in_features] -> [..., out_features], computed in float32, returned in x's dtype."""
        path = isa()
        if path == "none":
            return F.linear(x.float(), self.dequantize(), self.bias).to(x.dtype)
        # Decoding calls this ~120 times a token with one row: each op spared here counts.
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.float32 or not rows.is_contiguous():
            rows = rows.float().contiguous()
        if self.in_order is not None:
            rows = rows.index_select(1, self.in_order)
        if rows.shape[0] >= DEQUANTIZED_FROM_ROWS[path]:
            y = torch.ops.yaie.quant_matmul_dequantized(
                rows, self.qweight, self.scales, self.mins, self.bias, self.out_features, TILE_ROWS
            )
        else:
            y = torch.ops.yaie.quant_matmul(
                rows, self.qweight, self.scales, self.mins, self.bias, self.out_features, ISAS.index(path)
            )
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)


class QuantizedEmbedding(nn.Module):
    """Token embeddings looked up in a quantized table: each step dequantizes only the rows of
    its tokens. A tied LM head's table serves both (`from_linear` shares its tensors), so a GGUF
    file's embedding is held once, in its stored type, instead of also as a dense copy."""

    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        """The table's tensors in QuantizedLinear's layout; lookups return `dtype`, the model's."""
        super().__init__()
        self.dtype = dtype
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def from_linear(cls, linear: QuantizedLinear, dtype: torch.dtype) -> QuantizedEmbedding:
        """Look up in `linear`'s weight rows, sharing (not copying) its tensors."""
        if linear.in_order is not None:
            raise ValueError("a weight with permuted input features cannot serve as an embedding table")
        return cls(linear.qweight, linear.scales, linear.mins, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """[tokens] ids -> [tokens, dim] in the model's dtype."""
        if isa() != "none":  # one native call, where the lines below take a dozen tensor ops
            return torch.ops.yaie.quant_embedding(self.qweight, self.scales, self.mins, ids).to(self.dtype)
        # The kernels' layout interleaves rows in groups of GROUP_ROWS: dequantize each token's
        # group (a few KiB) and keep its row.
        groups = dequantize_groups(self.qweight, self.scales, self.mins, ids // GROUP_ROWS)
        rows = groups[torch.arange(ids.shape[0], device=ids.device), ids % GROUP_ROWS]
        return rows.to(self.dtype)


def dequantize_groups(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      index: torch.Tensor | None = None) -> torch.Tensor:
    """Packed weight groups (csrc/quant_common.h's layout) as float32 [groups, GROUP_ROWS, K]:
    every group, or the ones at `index`."""
    if index is not None:
        qweight, scales = qweight[index], scales[index]
        mins = None if mins is None else mins[index]
    groups, blocks, _ = qweight.shape
    if mins is not None:
        pairs = qweight.view(groups, blocks, 2, 1, BLOCK)
        q = torch.cat([pairs & 0x0F, pairs >> 4], dim=3).view(groups, blocks, GROUP_ROWS, BLOCK).float()
        w = q * scales.float()[..., None] + mins.float()[..., None]
    else:
        q = qweight.view(groups, blocks, GROUP_ROWS, 2, BLOCK // 2).float()
        halves = scales.float().view(groups, blocks, -1, GROUP_ROWS).transpose(2, 3)  # [.., rows, 1 or 2]
        w = (q * halves[..., None]).view(groups, blocks, GROUP_ROWS, BLOCK)
    return w.permute(0, 2, 1, 3).reshape(groups, GROUP_ROWS, blocks * BLOCK)
