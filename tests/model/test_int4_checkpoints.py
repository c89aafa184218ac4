"""AWQ and GPTQ int4 checkpoints run as int4 (yaie/model/int4_checkpoints.py).

The checkpoints are tiny random models quantized and packed here, by a packer written from the
formats' descriptions (AutoAWQ's GEMM layout; AutoGPTQ / GPTQModel's, v1 and v2, with and
without act-order), independently of the loader's unpacking. Checked:
  * exact: every quantized layer dequantizes to scale * (q - zero) of the values the packer
    quantized, computed here in numpy, so fused q/k/v and gate/up rows, AWQ's nibble order,
    GPTQ's zero offset and act-order's channel permutation are all in the right place;
  * the model's logits against a dense checkpoint of the same dequantized weights, within the
    bound test_quantized_model.py states for the kernels' int8 activations (the LM head stays
    dense here, so 4 L of its 4 L + 1 matmuls are quantized: the bound holds with room);
  * `--quantization none`: the dequantized weights in --dtype, bit-exact;
  * what cannot run as int4 is refused, saying what and why.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.test_quantized_model import (
    CPU,
    LINEARS,
    NUM_LAYERS,
    assert_logits_within_bound,
    checked_logits,
    load,
    logits,
)
from tests.model.tiny_models import make_tiny_model
from yaie.errors import ModelLoadError, UnsupportedModelError
from yaie.model.linear import ConcatLinear, DenseLinear
from yaie.model.loader_hf import HFCheckpoint
from yaie.model.quantized_linear import QuantizedLinear
from yaie.ops import select_ops

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Our fused layers and the projections whose rows they stack, in order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "self_attn.o_proj": ("self_attn.o_proj",),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
         "mlp.down_proj": ("mlp.down_proj",)}  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds output column AWQ_ORDER[k]


@dataclass(frozen=True)
class Format:
    method: str  # awq, gptq
    group_size: int
    desc_act: bool = False
    checkpoint_format: str = "gptq"  # GPTQ's v1 ("gptq") or v2 ("gptq_v2")

    def quantization_config(self) -> dict:
        if self.method == "awq":
            return {"quant_method": "awq", "bits": 4, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm"}  # fmt: skip
        return {"quant_method": "gptq", "bits": 4, "group_size": self.group_size, "desc_act": self.desc_act,
                "sym": False, "checkpoint_format": self.checkpoint_format}  # fmt: skip


@dataclass
class Quantized:
    """One projection as the packer quantized it: W[o, i] = scales[g, o] * (q[i, o] - zeros[g, o])
    with g = groups[i]."""

    q: np.ndarray  # [in, out] in 0..15
    zeros: np.ndarray  # [groups, out]
    scales: np.ndarray  # float16 [groups, out]
    groups: np.ndarray  # [in]

    def dequantized(self) -> torch.Tensor:
        """[out, in] float32, from float64 products (each is exact in float32)."""
        g = self.groups
        w = self.scales[g].astype(np.float64) * (self.q.astype(np.float64) - self.zeros[g])
        return torch.from_numpy(np.ascontiguousarray(w.T, dtype=np.float32))


def quantize(weight: torch.Tensor, groups: np.ndarray, lowest_zero: int) -> Quantized:
    """Asymmetric 4-bit quantization of W [out, in] per group of input channels (min to max in 16
    levels); zeros from `lowest_zero` up (GPTQ v1 cannot store a zero of 0)."""
    wt = weight.detach().double().numpy().T  # [in, out]
    n_groups = int(groups.max()) + 1
    scales = np.zeros((n_groups, wt.shape[1]), np.float16)
    zeros = np.zeros((n_groups, wt.shape[1]), np.int64)
    q = np.zeros(wt.shape, np.int64)
    for g in range(n_groups):
        rows = groups == g
        low, high = np.minimum(wt[rows].min(axis=0), 0), np.maximum(wt[rows].max(axis=0), 0)
        scale = np.maximum((high - low) / 15, 1e-4).astype(np.float16)
        zero = np.clip(np.round(-low / scale), lowest_zero, 15)
        scales[g], zeros[g] = scale, zero
        q[rows] = np.clip(np.round(wt[rows] / scale) + zero, 0, 15)
    return Quantized(q, zeros, scales, groups)


def words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] values in 0..15 -> int32 [...] holding value k in bits 4k to 4k + 3."""
    out = np.zeros(nibbles.shape[:-1], np.uint32)
    for k in range(8):
        out |= (nibbles[..., k].astype(np.uint32) & 0xF) << np.uint32(4 * k)
    return out.view(np.int32)


def pack(layer: Quantized, fmt: Format) -> dict[str, torch.Tensor]:
    """The layer's tensors as AutoAWQ (GEMM) or AutoGPTQ / GPTQModel save them."""
    k, n = layer.q.shape
    if fmt.method == "awq":  # both packed along out, eight columns a word in AWQ's order
        qweight = words(layer.q.reshape(k, n // 8, 8)[..., list(AWQ_ORDER)])
        qzeros = words(layer.zeros.reshape(-1, n // 8, 8)[..., list(AWQ_ORDER)])
        extra = {}
    else:  # qweight packed along in, qzeros along out, both in order; v1 stores zero - 1
        qweight = words(layer.q.reshape(k // 8, 8, n).transpose(0, 2, 1))
        stored = layer.zeros - (1 if fmt.checkpoint_format == "gptq" else 0)
        qzeros = words(stored.reshape(-1, n // 8, 8))
        extra = {"g_idx": torch.from_numpy(layer.groups.astype(np.int32))}
    tensors = {"qweight": torch.from_numpy(qweight), "qzeros": torch.from_numpy(qzeros),
               "scales": torch.from_numpy(layer.scales)}  # fmt: skip
    return tensors | extra


def input_groups(k: int, fmt: Format, gen: np.random.Generator) -> np.ndarray:
    """Each input channel's group: consecutive channels, or with act-order a random channel
    order cut into groups (what GPTQ's g_idx records)."""
    size = k if fmt.group_size == -1 else fmt.group_size
    if not fmt.desc_act:
        return np.arange(k) // size
    groups = np.empty(k, np.int64)
    groups[gen.permutation(k)] = np.arange(k) // size
    return groups


def write_int4_checkpoint(root: Path, kind: str, fmt: Format, shared_orders: bool = True
                          ) -> dict[str, Quantized]:
    """A tiny `kind` model saved in root/int4 in format `fmt`, and a dense copy of its dequantized
    weights in root/dense. Returns every projection as quantized, by HF module name. With
    act-order, projections that share an input (q, k, v; gate, up) share a channel order, as
    GPTQ's (one Hessian per input) gives them, unless `shared_orders` is False."""
    path = root / "int4"
    model = make_tiny_model(kind, path)
    gen = np.random.default_rng(7)
    orders: dict[str, np.ndarray] = {}
    tensors: dict[str, torch.Tensor] = {}
    dense: dict[str, torch.Tensor] = {}
    layers: dict[str, Quantized] = {}
    for name, weight in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        module = name.removesuffix(".weight")
        projection = module.rpartition(".")[2]
        if projection not in PROJECTIONS or not name.endswith(".weight"):
            tensors[name] = dense[name] = weight.contiguous()
            continue
        site = module.replace(projection, {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
                              .get(projection, projection)) if shared_orders else module  # fmt: skip
        if site not in orders:
            orders[site] = input_groups(weight.shape[1], fmt, gen)
        lowest_zero = 1 if fmt.method == "gptq" and fmt.checkpoint_format == "gptq" else 0
        layers[module] = quantize(weight, orders[site], lowest_zero)
        tensors |= {f"{module}.{part}": t for part, t in pack(layers[module], fmt).items()}
        dense[name] = layers[module].dequantized()
    config = json.loads((path / "config.json").read_text())
    (path / "model.safetensors").unlink()
    shutil.copytree(path, root / "dense")
    save_file(dense, root / "dense" / "model.safetensors")
    save_file(tensors, path / "model.safetensors")
    config["quantization_config"] = fmt.quantization_config()
    (path / "config.json").write_text(json.dumps(config))
    return layers


def fused_dequantized(layers: dict[str, Quantized], i: int, ours: str) -> torch.Tensor:
    """Our fused layer's weight: its projections' dequantized rows, stacked."""
    return torch.cat([layers[f"model.layers.{i}.{hf}"].dequantized() for hf in FUSED[ours]])


FORMATS = {
    "awq-g32": (Format("awq", 32), "llama"),
    "awq-g64-tied-bias": (Format("awq", 64), "qwen2"),
    "awq-per-row": (Format("awq", -1), "llama"),
    "gptq-g32": (Format("gptq", 32), "llama"),
    "gptq_v2-g64-tied-bias": (Format("gptq", 64, checkpoint_format="gptq_v2"), "qwen2"),
    "gptq-act-order": (Format("gptq", 32, desc_act=True), "llama"),
    "gptq-act-order-g64-tied-bias": (Format("gptq", 64, desc_act=True), "qwen2"),
}


@pytest.mark.parametrize("case", FORMATS)
def test_runs_as_int4(tmp_path, case, native_kernels, monkeypatch):
    fmt, kind = FORMATS[case]
    layers = write_int4_checkpoint(tmp_path, kind, fmt)
    ours = load(tmp_path / "int4", "auto")
    assert ours.quantization == fmt.method.upper()
    assert ours.kernel_isa == select_ops(CPU).quant_isa
    for i in range(NUM_LAYERS):
        for name in LINEARS:
            layer = ours.model.get_submodule(f"layers.{i}.{name}")
            assert isinstance(layer, QuantizedLinear) and layer.weight_type == fmt.method.upper(), name
            assert torch.equal(layer.dequantize(), fused_dequantized(layers, i, name)), name
            # Act-order permutes the input features of layers with more than one group.
            assert (layer.in_order is not None) == (fmt.desc_act and layer.in_features > fmt.group_size), name
    assert isinstance(ours.model.lm_head, DenseLinear)  # AWQ and GPTQ leave the LM head dense
    assert_logits_within_bound(checked_logits(ours, monkeypatch), logits(load(tmp_path / "dense", "none")))


def test_act_order_feeds_many_rows_the_permuted_features(tmp_path, native_kernels):
    """A prompt's rows take the many-row kernels (whole tiles of weight rows on AVX512-VNNI):
    permuted alike, each row bit for bit what it is alone."""
    layers = write_int4_checkpoint(tmp_path, "llama", Format("gptq", 32, desc_act=True))
    layer = load(tmp_path / "int4", "auto").model.layers[0].mlp.down_proj
    assert layer.in_order is not None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, layer.in_features, generator=gen)
    y = layer(x)
    assert torch.equal(y, torch.cat([layer(x[i : i + 1]) for i in range(64)]))
    w = layers["model.layers.0.mlp.down_proj"].dequantized().double()
    # The activations are rounded to int8 per 32 of the permuted features: each by at most half
    # its block's step, max|x| / 254 (test_quant_kernels.py); plus float32 sums' 1e-5.
    permuted = x.double()[:, layer.in_order]
    steps = permuted.abs().view(64, -1, 32).amax(-1).repeat_interleave(32, dim=1) / 254
    steps = steps[:, torch.argsort(layer.in_order)]  # back to the features' own order
    bound = steps @ w.abs().T + 1e-5 * (x.double().abs() @ w.abs().T)
    assert ((y.double() - x.double() @ w.T).abs() <= bound).all()


def test_act_order_shards_in_different_orders_run_each_in_its_own(tmp_path, native_kernels, monkeypatch):
    """q, k and v that take their input in different orders cannot share one packed layer: the
    fused projection is a ConcatLinear of one int4 layer per shard, each in its own order."""
    layers = write_int4_checkpoint(tmp_path, "llama", Format("gptq", 32, desc_act=True), shared_orders=False)
    ours = load(tmp_path / "int4", "auto")
    for i in range(NUM_LAYERS):
        for name in LINEARS:
            layer = ours.model.get_submodule(f"layers.{i}.{name}")
            if name in ("self_attn.qkv_proj", "mlp.gate_up_proj"):
                assert isinstance(layer, ConcatLinear), name
                assert [type(p) for p in layer.parts] == [QuantizedLinear] * len(FUSED[name]), name
                for part, hf in zip(layer.parts, FUSED[name], strict=True):
                    assert isinstance(part, QuantizedLinear) and part.in_order is not None
                    shard = layers[f"model.layers.{i}.{hf}"].dequantized()
                    torch.testing.assert_close(part.dequantize(), shard, rtol=0, atol=0)
            else:
                assert isinstance(layer, QuantizedLinear), name
        torch.testing.assert_close(ours.model.layers[i].mlp.down_proj.dequantize(),
                                   fused_dequantized(layers, i, "mlp.down_proj"), rtol=0, atol=0)  # fmt: skip
    assert_logits_within_bound(checked_logits(ours, monkeypatch), logits(load(tmp_path / "dense", "none")))


@pytest.mark.parametrize("case", ["awq-g32", "gptq-g32", "gptq_v2-g64-tied-bias", "gptq-act-order"])
def test_none_dequantizes_exactly(tmp_path, case):
    fmt, kind = FORMATS[case]
    layers = write_int4_checkpoint(tmp_path, kind, fmt)
    weights = dict(HFCheckpoint(tmp_path / "int4").weights(torch.float32))
    for module, layer in layers.items():
        assert torch.equal(weights[f"{module}.weight"], layer.dequantized()), module
    ours = load(tmp_path / "int4", "none")
    assert ours.quantization == "none"
    assert torch.equal(logits(ours), logits(load(tmp_path / "dense", "none")))


# --- what does not run as int4 -------------------------------------------------------------------------

AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32}
REFUSED = {
    "bits": ({**GPTQ, "bits": 8}, r"GPTQ bits=8 .*4-bit"),
    "group-of-16": ({**AWQ, "group_size": 16}, r"AWQ group_size=16 .*multiple of 32"),
    "group-of-48": ({**GPTQ, "group_size": 48}, r"GPTQ group_size=48 .*multiple of 32"),
    "awq-gemv": ({**AWQ, "version": "gemv"}, r"AWQ version 'gemv'"),
    "awq-no-zero": ({**AWQ, "zero_point": False}, r"zero_point=false"),
    "gptq-marlin": ({**GPTQ, "checkpoint_format": "marlin"}, r"format 'marlin' .*supported: gptq, gptq_v2"),
    "method": ({"quant_method": "bitsandbytes", "bits": 4}, r"'bitsandbytes' .*supported: awq, gptq"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_unsupported_quantization_config_says_why(tmp_path, case):
    write_int4_checkpoint(tmp_path, "llama", Format("awq", 32))
    config = json.loads((tmp_path / "int4" / "config.json").read_text())
    config["quantization_config"], message = REFUSED[case]
    (tmp_path / "int4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=message):
        load(tmp_path / "int4", "auto")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_requantizing_an_int4_checkpoint_says_why(tmp_path, scheme):
    write_int4_checkpoint(tmp_path, "llama", Format("gptq", 32))
    with pytest.raises(ModelLoadError, match=rf"already stores GPTQ int4 weights.*{scheme}.*auto.*none"):
        load(tmp_path / "int4", scheme)


def test_groups_that_no_channel_order_makes_whole_blocks_say_why(tmp_path, native_kernels):
    """A g_idx whose groups are not each a multiple of 32 channels leaves a 32-block two scales
    in any order: refused as int4, while `none` still runs it dequantized."""
    write_int4_checkpoint(tmp_path, "llama", Format("gptq", 32, desc_act=True))
    name = "model.layers.0.self_attn.o_proj.g_idx"
    tensors = load_file(tmp_path / "int4" / "model.safetensors")
    g_idx = tensors[name]
    tensors[name] = torch.where(g_idx == 0, torch.ones_like(g_idx), g_idx)
    tensors[name][0] = 0  # group 0 keeps one channel, group 1 has 63
    save_file(tensors, tmp_path / "int4" / "model.safetensors")
    with pytest.raises(ValueError, match=r"GPTQ: g_idx gives a group .*not a multiple of 32.*none"):
        load(tmp_path / "int4", "auto")
    assert load(tmp_path / "int4", "none").quantization == "none"
