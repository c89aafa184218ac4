"""The quantized matmul kernels against PyTorch, for every weight format and every ISA path
this CPU runs: quant_layout's (QuantizedLinear) and the K-quants' super-blocks (KQuantLinear).

Two references, both in float64 over the weights the `gguf` package dequantizes:
  * exact: the activations quantized in Python exactly as the kernel does (int8 per 32-block,
    or per 256 for the K-quants, scale max|x| / 127, rounding half to even). The kernel differs
    from it only by float32 rounding: |y - ref| <= 1e-5 * sum_k |x_q[k] * w[k]|, the sum of the
    terms' magnitudes (the usual bound for a float32 sum; its K / 32 block terms need ~1e-6).
  * loose: the plain activations. Quantizing moves each activation by at most half a step,
    max|x_block| / 254, so |y - ref| <= sum over blocks of max|x_block| / 254 * sum |w| in the
    block, plus the exact bound's rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from yaie.model.gguf_blocks import KQUANT_GGML_TYPES, kquant_fields, unpack_gguf
from yaie.model.linear import Linear
from yaie.model.quantized_linear import KQuantEmbedding, KQuantLinear, QuantizedEmbedding, QuantizedLinear
from yaie.ops import Ops, select_ops
from yaie.ops import quant_layout as quant
from yaie.ops.kquant_layout import SUPER, pack_kquant
from yaie.ops.native_ops import cpu_isas
from yaie.ops.quant_layout import pack_weight

CPU = torch.device("cpu")

T = GGMLQuantizationType
TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q4_K, T.Q5_K, T.Q6_K, T.Q5_0, T.Q5_1, T.Q3_K, T.Q2_K, T.IQ4_NL, T.IQ4_XS]
PACKED_TYPES = [t for t in TYPES if t not in KQUANT_GGML_TYPES]  # quant_layout's
# The byte offsets of each block's float16 scale fields (random bytes there could be inf / NaN).
FP16_FIELDS = {
    T.Q8_0: (0,), T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q5_0: (0,),
    T.Q5_1: (0, 2), T.Q3_K: (108,), T.Q2_K: (80, 82), T.IQ4_NL: (0,), T.IQ4_XS: (0,),
}  # fmt: skip

# M, N, K: odd M and N (padded row groups), every M regime of the int8 kernels (blocks of four
# rows and the remainder; on AVX512-VNNI tiles of four row groups against 16, 8, 4, 2 and 1 rows,
# and the groups left over; the K-quants' tiles of 8, 4, 2 and 1 rows); K a multiple of 256 so
# that the K-quants fit too.
SHAPES = [
    (1, 1, 256), (1, 37, 512), (3, 13, 256), (4, 8, 256), (7, 33, 768), (13, 64, 256), (19, 80, 512),
    (31, 40, 256),
]  # fmt: skip
# The SIMD kernels take 32-value blocks in pairs: an odd number of blocks leaves one alone at the
# end (only types with 32-value blocks can have one).
ODD_BLOCK_SHAPES = [(1, 5, 32), (1, 9, 288), (5, 7, 96), (11, 70, 288)]
MATMUL_CASES = [(t, shape) for t in TYPES for shape in SHAPES] + [
    (t, shape) for t in (T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL) for shape in ODD_BLOCK_SHAPES
]


def random_blocks(ggml_type: GGMLQuantizationType, n: int, k: int, seed: int) -> np.ndarray:
    """Random raw GGUF blocks: every quantized value and packed scale bit pattern, with finite
    float16 scales of either sign."""
    gen = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = gen.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS[ggml_type]:
        scale = (gen.standard_normal((n, k // block_size, 1)) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(n, -1)


def block_of(ggml_type: GGMLQuantizationType) -> int:
    """How many values the kernel quantizes activations by, for weights of this type."""
    return SUPER if ggml_type in KQUANT_GGML_TYPES else quant.BLOCK


def quantized_activations(x: torch.Tensor, block: int = quant.BLOCK) -> torch.Tensor:
    """x [M, K] as the kernel quantizes it, dequantized in float64 (q * d is exact there)."""
    blocks = x.view(x.shape[0], -1, block)
    scale = blocks.abs().amax(dim=-1, keepdim=True) * torch.tensor(1 / 127, dtype=torch.float32)
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    q = torch.round(blocks * inverse).clamp(-127, 127)
    return (q.double() * scale.double()).view_as(x)


def random_activations(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[0, : quant.BLOCK] = 0  # an all-zero block: scale 0
    return x


def assert_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    err = (y.double() - ref).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"error {err.view(-1)[worst]:.3g} > bound {bound.view(-1)[worst]:.3g}"


def ops() -> Ops:
    """The op backend a model loaded now would run on (as YAIE_QUANT_ISA and the fixtures set)."""
    return select_ops(CPU)


def from_gguf(data, ggml_type, n: int, k: int, bias=None, *, ops: Ops) -> Linear:
    """A layer of a GGUF tensor's raw blocks, [n out, k in], as the loader makes it."""
    if ggml_type in KQUANT_GGML_TYPES:
        return KQuantLinear([pack_kquant(kquant_fields(data, ggml_type, n, k))], n, bias, ops=ops)
    packed = pack_weight(unpack_gguf(data, ggml_type, n, k))
    return QuantizedLinear(*packed, n, bias, T(ggml_type).name, ops=ops)


@pytest.fixture(params=quant.ISAS)
def isa(request, native_kernels, monkeypatch) -> str:
    if request.param not in cpu_isas():
        pytest.skip(f"this CPU lacks {request.param} (it has {', '.join(cpu_isas())})")
    monkeypatch.setenv("YAIE_QUANT_ISA", request.param)
    assert ops().quant_isa == request.param
    return request.param


@pytest.mark.parametrize(
    ("ggml_type", "shape"), MATMUL_CASES, ids=[f"{t.name}-{'x'.join(map(str, s))}" for t, s in MATMUL_CASES]
)
def test_matmul_matches_reference_on_quantized_activations(ggml_type, shape, isa):
    m, n, k = shape
    raw = random_blocks(ggml_type, n, k, seed=m * n)
    bias = torch.randn(n)
    layer = from_gguf(raw, ggml_type, n, k, bias=bias, ops=ops())
    w = torch.from_numpy(dequantize(raw, ggml_type)).double()
    x = random_activations(m, k, seed=k)

    y = layer(x)

    block = block_of(ggml_type)
    xq = quantized_activations(x, block)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_within(y, xq @ w.T + bias.double(), 1e-5 * (xq.abs() @ w.abs().T + bias.double().abs()))
    # Activation quantization error: half a step per value, max|x_block| / 254.
    half_step = x.view(m, -1, block).abs().amax(-1).double() / 254
    block_w = w.abs().view(n, -1, block).sum(-1)
    exact = x.double() @ w.T + bias.double()
    assert_within(y, exact, half_step @ block_w.T + 1e-5 * (x.double().abs() @ w.abs().T + bias.abs()))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_K], ids=lambda t: t.name)
def test_activations_on_rounding_ties_round_as_the_reference_does(ggml_type, isa):
    """Every value but each block's max sits on a tie, (k + 1/2) * scale, where an ulp in
    1 / scale decides which way it rounds (-ffast-math once made the AVX2 path's 127 / amax)."""
    m, k, block = 16, 1024, block_of(ggml_type)
    gen = torch.Generator().manual_seed(0)
    amax = torch.rand(m, k // block, 1, generator=gen) * 4 + 0.1
    steps = torch.randint(-127, 126, (m, k // block, block), generator=gen)
    x = (steps + 0.5) * (amax * torch.tensor(1 / 127, dtype=torch.float32))
    x[..., :1] = amax
    x = x.view(m, k)
    raw = random_blocks(ggml_type, 4, k, seed=1)
    layer = from_gguf(raw, ggml_type, 4, k, ops=ops())
    w = torch.from_numpy(dequantize(raw, ggml_type)).double()
    xq = quantized_activations(x, block)
    assert_within(layer(x), xq @ w.T, 1e-5 * (xq.abs() @ w.abs().T))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_no_rows_give_no_rows(ggml_type, isa):
    """A step in which no sequence samples asks the LM head for zero rows."""
    raw = random_blocks(ggml_type, 8, 256, seed=6)
    layer = from_gguf(raw, ggml_type, 8, 256, bias=torch.ones(8), ops=ops())
    assert layer(torch.empty(0, 256)).shape == (0, 8)


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_rows_are_batch_invariant(ggml_type, isa):
    """Every layer takes its integer kernel at any row count, whichever of its loops (rows by 16,
    8, 4, 2 or 1; one row two blocks at a time; whole tiles of 16 weight rows and the groups
    left over) takes a row: each row's output is bit for bit what it is alone, whatever rows share
    its call. 45 rows: tiles of 16 and a padded group; 23 blocks of 32: an odd count."""
    n, k = 45, 768 if ggml_type in KQUANT_GGML_TYPES else 736
    raw = random_blocks(ggml_type, n, k, seed=12)
    layer = from_gguf(raw, ggml_type, n, k, bias=torch.randn(n), ops=ops())
    x = random_activations(23, k, seed=13)
    together = layer(x)
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(23)]), together)
    assert torch.equal(layer(x[5:16]), together[5:16])


@pytest.mark.parametrize("isa_path", ["scalar", "native"])
def test_kquant_parts_of_different_types_share_one_activation(isa_path, native_kernels, monkeypatch):
    """A fused projection stacked from parts of different types (q, k in Q4_K above v in Q6_K,
    a Q5_K part ending in a padded record) is the parts' rows in order, plus the bias."""
    if isa_path == "scalar":
        monkeypatch.setenv("YAIE_QUANT_ISA", "scalar")
    types = [(T.Q4_K, 48), (T.Q6_K, 32), (T.Q5_K, 21)]
    k = 512
    raws = [random_blocks(t, n, k, seed=20 + i) for i, (t, n) in enumerate(types)]
    parts = [pack_kquant(kquant_fields(raw, t, n, k)) for raw, (t, n) in zip(raws, types, strict=True)]
    bias = torch.randn(101)
    layer = KQuantLinear(parts, 101, bias, ops=ops())
    assert layer.weight_type == "Q4_K+Q6_K+Q5_K"
    w = torch.cat([torch.from_numpy(dequantize(r, t)) for r, (t, _) in zip(raws, types, strict=True)])
    w = w.double()
    assert torch.equal(layer.dequantize().double(), w)
    x = random_activations(6, k, seed=21)
    xq = quantized_activations(x, SUPER)
    assert_within(layer(x), xq @ w.T + bias.double(), 1e-5 * (xq.abs() @ w.abs().T + bias.double().abs()))


@pytest.mark.parametrize("out_features", [33, 16])
def test_kquant_out_features_must_match_the_parts_rows(out_features, native_kernels):
    """Two parts of 16 rows hold 17 to 32 outputs (the last part's padding rows dropped)."""
    k = 256
    parts = [pack_kquant(kquant_fields(random_blocks(T.Q4_K, 16, k, seed=n), T.Q4_K, 16, k)) for n in (1, 2)]
    assert KQuantLinear(parts, 32, ops=ops())(torch.randn(1, k)).shape == (1, 32)
    with pytest.raises(RuntimeError, match="out_features does not match the parts' rows"):
        KQuantLinear(parts, out_features, ops=ops())(torch.randn(1, k))


@pytest.mark.parametrize("ggml_type", PACKED_TYPES, ids=lambda t: t.name)
def test_unpacked_blocks_are_the_factors_gguf_multiplies(ggml_type):
    """Before packing: scale * value (+ min) per 32 values, in float32, is the weight the `gguf`
    package dequantizes, bit for bit, each type in its own bits a value: the value a centred code's
    q - offset, IQ4_NL's code's level."""
    raw = random_blocks(ggml_type, 11, 512, seed=10)
    u = unpack_gguf(raw, ggml_type, 11, 512)
    bits = {T.Q8_0: 8, T.Q5_0: 5, T.Q5_1: 5}.get(ggml_type, 4)
    assert (u.bits, u.levels) == (bits, ggml_type == T.IQ4_NL)
    assert u.values.dtype == (np.int8 if bits == 8 else np.uint8) and u.values.max() < (1 << bits)
    assert (u.mins is not None) == (ggml_type in (T.Q4_1, T.Q5_1))
    if u.levels:
        values = quant.IQ4_LEVELS[u.values].astype(np.float32)
    elif u.mins is None and bits != 8:
        values = u.values.astype(np.float32) - (1 << (bits - 1))
    else:
        values = u.values.astype(np.float32)
    w = values * np.repeat(u.scales, quant.BLOCK, axis=1)
    if u.mins is not None:
        w = w + np.repeat(u.mins, quant.BLOCK, axis=1)
    assert np.array_equal(w, dequantize(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_repacked_weights_dequantize_to_what_gguf_computes(ggml_type):
    raw = random_blocks(ggml_type, 11, 512, seed=1)
    layer = from_gguf(raw.tobytes(), ggml_type, 11, 512, ops=ops())
    assert torch.equal(layer.dequantize(), torch.from_numpy(dequantize(raw, ggml_type)))


@pytest.mark.parametrize("ggml_type", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_weights_gguf_quantized_dequantize_to_what_gguf_computes(ggml_type):
    """Blocks as gguf-py's quantizer writes them (llama.cpp's reference rounding), where it has one."""
    gen = np.random.default_rng(5)
    weight = (gen.standard_normal((9, 256)) * gen.uniform(0.01, 1, (9, 1))).astype(np.float32)
    raw = quantize(weight, ggml_type)
    layer = from_gguf(raw, ggml_type, 9, 256, ops=ops())
    assert torch.equal(layer.dequantize(), torch.from_numpy(dequantize(raw, ggml_type)))


@pytest.mark.parametrize("path", ["native_kernels", "pytorch_only"])
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_weight_rows(ggml_type, path, request):
    """A quantized table looked up by token: the rows GGUF dequantizes, in any order, repeated,
    from padded row groups too (11 rows), natively or in PyTorch."""
    request.getfixturevalue(path)
    raw = random_blocks(ggml_type, 11, 512, seed=8)
    layer = from_gguf(raw, ggml_type, 11, 512, ops=ops())
    table: torch.nn.Module
    if isinstance(layer, KQuantLinear):
        table = KQuantEmbedding(layer.parts[0], torch.float32, ops=ops())
    else:
        assert isinstance(layer, QuantizedLinear)
        table = QuantizedEmbedding.from_linear(layer, torch.float32)
    ids = torch.tensor([10, 0, 3, 3, 7, 4])

    rows = table(ids)

    torch.testing.assert_close(rows, torch.from_numpy(dequantize(raw, ggml_type))[ids], rtol=1e-6, atol=0)


def test_embedding_refuses_ids_outside_the_table(native_kernels):
    layer = from_gguf(random_blocks(T.Q8_0, 8, 256, seed=9), T.Q8_0, 8, 256, ops=ops())
    assert isinstance(layer, QuantizedLinear)
    with pytest.raises(RuntimeError, match="outside the table"):
        QuantizedEmbedding.from_linear(layer, torch.float32)(torch.tensor([8]))
    table = pack_kquant(kquant_fields(random_blocks(T.Q6_K, 16, 256, seed=9), T.Q6_K, 16, 256))
    with pytest.raises(RuntimeError, match="outside the table"):
        KQuantEmbedding(table, torch.float32, ops=ops())(torch.tensor([16]))


# GGUF stores these formats' scales (and Q4_1's and Q5_1's mins, Q4_0's -8 d) as float16 values.
SCALES_IN_FLOAT16 = {T.Q8_0: True, T.Q4_0: True, T.Q4_1: True, T.Q5_0: True, T.Q5_1: True, T.IQ4_NL: True}


@pytest.mark.parametrize("ggml_type", PACKED_TYPES, ids=lambda t: t.name)
def test_scales_are_float16_where_that_is_exact(ggml_type):
    raw = random_blocks(ggml_type, 11, 512, seed=4)
    layer = from_gguf(raw, ggml_type, 11, 512, ops=ops())
    assert isinstance(layer, QuantizedLinear)
    expected = torch.float16 if SCALES_IN_FLOAT16[ggml_type] else torch.float32
    assert layer.scales.dtype == expected
    assert layer.mins is None or layer.mins.dtype == expected
    # Both storage types run in every path (the matmul tests above cover both through TYPES).
    dense = QuantizedLinear.quantize(torch.randn(8, 256), "int4", ops=ops())
    assert dense.scales.dtype == torch.float32  # max - min over 15 is rarely a float16 value


@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_without_native_kernels_the_dequantized_weights_are_used(ggml_type, pytorch_only):
    raw = random_blocks(ggml_type, 6, 256, seed=2)
    layer = from_gguf(raw, ggml_type, 6, 256, ops=ops())
    x = random_activations(2, 256, seed=5)
    w = torch.from_numpy(dequantize(raw, ggml_type))
    assert ops().quant_isa == "none"
    torch.testing.assert_close(layer(x), x @ w.T)


@pytest.mark.parametrize(("scheme", "group_size"), [("int8", 32), ("int4", 32), ("int4", 128)])
def test_quantize_dense_weight(scheme, group_size, isa):
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(19, 256, generator=gen)
    layer = QuantizedLinear.quantize(weight, scheme, group_size, ops=ops())

    w = layer.dequantize().double()
    # Rounding to the nearest level: within half a step of the group's scale.
    groups = weight.view(19, -1, group_size)
    spread = groups.abs().amax(-1) / 127 if scheme == "int8" else (groups.amax(-1) - groups.amin(-1)) / 15
    half_step = (spread / 2 * (1 + 1e-5)).repeat_interleave(group_size, dim=1)
    assert bool(((w - weight.double()).abs() <= half_step).all())

    x = random_activations(5, 256, seed=4)
    xq = quantized_activations(x)
    assert_within(layer(x), xq @ w.T, 1e-5 * (xq.abs() @ w.abs().T))


def test_unsupported_type_names_itself_and_the_supported_ones():
    supported = "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, Q4_K, Q5_K, Q6_K, Q3_K, Q2_K, IQ4_XS"
    with pytest.raises(ValueError, match=rf"IQ2_XXS.*supported: {supported}"):
        from_gguf(b"", T.IQ2_XXS, 4, 256, ops=ops())


@pytest.mark.parametrize(("ggml_type", "k"), [(T.Q4_K, 288), (T.Q8_0, 48)])
def test_in_features_must_fill_whole_blocks(ggml_type, k):
    with pytest.raises(ValueError, match=f"{ggml_type.name} packs .* in_features={k} is not a multiple"):
        from_gguf(b"", ggml_type, 4, k, ops=ops())


def test_forcing_an_isa_this_cpu_lacks_says_which_it_has(native_kernels, monkeypatch):
    missing = [name for name in quant.ISAS if name not in cpu_isas()]
    if not missing:
        pytest.skip("this CPU has every ISA path")
    monkeypatch.setenv("YAIE_QUANT_ISA", missing[0])
    with pytest.raises(ValueError, match=f"YAIE_QUANT_ISA={missing[0]} is not available.*available: scalar"):
        ops()


@pytest.mark.parametrize("path", ["native", "pytorch"])
def test_bfloat16_activations_come_back_in_bfloat16(path, request):
    request.getfixturevalue("native_kernels" if path == "native" else "pytorch_only")
    raw = random_blocks(T.Q4_1, 8, 256, seed=3)
    layer = from_gguf(raw, T.Q4_1, 8, 256, ops=ops())
    x = random_activations(2, 256, seed=6).bfloat16()
    y = layer(x)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, layer(x.float()).bfloat16())
