"""Whole models with quantized linear layers (EngineConfig.quantization), against the same
checkpoint run dense.

Two checks per model:
  * exact: every quantized layer dequantizes to the weight the dense path ("none") loads, so
    fusing q/k/v and gate/up, un-permuting llama.cpp's Q/K rows and the tied LM head all put
    the right quantized rows in the right place;
  * every layer, as the model calls it: the kernels quantize each activation row to int8 per
    32 values (per 256 for the K-quants' super-blocks); a PyTorch product of the activations
    quantized the same way (tests/model/test_quant_kernels.py) and the dequantized weights
    differs only by float32 rounding, |y - ref| <= 1e-5 * sum_k |x_q[k] * w[k]| (the kernel
    tests' bound). Checked per layer, not on the logits: a rounding difference can tip an
    activation onto the next int8 step downstream, which no float32 bound covers;
  * logits, loose, against the dense path: quantizing moves every activation by at most half a
    step, max|x_block| / 254, relative to the block's largest value rather than to the output,
    so we allow a full step, 1/127, of relative error for each of the 4 L + 1 matmuls a token
    passes (qkv, o, gate_up, down per layer, then the LM head): (4 L + 1) / 127 of the largest
    logit, 7% for these 2-layer models (int8 weights add as much again).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.model.gguf_writer import Q, byte_level_vocab, gguf_tensor_name, write_gguf
from tests.model.test_quant_kernels import quantized_activations
from tests.model.tiny_models import make_tiny_model, randomize
from yaie.config import EngineConfig
from yaie.errors import ModelLoadError, UnsupportedModelError
from yaie.llm import LLM
from yaie.model.attention import AttentionMetadata, PrefillSeq
from yaie.model.config import ModelConfig
from yaie.model.gguf_blocks import KQUANT_GGML_TYPES
from yaie.model.linear import ConcatLinear, DenseLinear
from yaie.model.llama import CausalLM
from yaie.model.loader import LoadedModel, load_model, load_weights
from yaie.model.loader_gguf import GGUFCheckpoint
from yaie.model.quantization import weight_types
from yaie.model.quantized_linear import KQuantEmbedding, KQuantLinear, QuantizedEmbedding, QuantizedLinear
from yaie.ops import TorchOps, select_ops
from yaie.ops.kquant_layout import SUPER

CPU = torch.device("cpu")
PROMPT = "the quick brown fox jumps over the lazy dog, hello world!"
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
NUM_LAYERS = 2
LOGITS_BOUND = (4 * NUM_LAYERS + 1) / 127  # of max |logits|; see the module docstring
# The K-quant kernels quantize activations per 256 values, whose largest one is further from the
# typical value than a 32-value block's (~1.4x for Gaussian activations): twice the bound.
K_LOGITS_BOUND = 2 * LOGITS_BOUND


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[str]]:
    return byte_level_vocab(63)


def config_kwargs(tokens: list[str], hidden: int, intermediate: int) -> dict:
    eot = tokens.index("<|endoftext|>")
    return dict(
        vocab_size=len(tokens), hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=NUM_LAYERS, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=50000.0,
        bos_token_id=eot, eos_token_id=eot,
    )  # fmt: skip


@pytest.fixture(scope="module")
def llama(vocab) -> LlamaForCausalLM:
    cfg = LlamaConfig(**config_kwargs(vocab[0], 64, 128), tie_word_embeddings=False)
    return randomize(LlamaForCausalLM(cfg), seed=11)


@pytest.fixture(scope="module")
def qwen2(vocab) -> Qwen2ForCausalLM:
    """qkv biases, tied embeddings: the LM head is the quantized embedding table."""
    cfg = Qwen2Config(**config_kwargs(vocab[0], 64, 128), tie_word_embeddings=True)
    return randomize(Qwen2ForCausalLM(cfg), seed=12)


def write(tmp_path: Path, vocab, arch: str, model, qtype, **kw) -> Path:
    return write_gguf(tmp_path / f"{arch}-{qtype.name}.gguf", arch, model.config, model.state_dict(), *vocab,
                      tensor_type=qtype, **kw)  # fmt: skip


# Each type's float16 fields' byte offsets, and a spread of its super-block scale d that makes
# weights O(1 / sqrt(cols)) (d times the spread of its sub-scales and values).
K_BLOCK_SCALES = {
    Q.Q4_K: ((0, 2), 2e-4), Q.Q5_K: ((0, 2), 1e-4), Q.Q6_K: ((208,), 4e-4), Q.Q3_K: ((108,), 1.5e-3),
    Q.Q2_K: ((80, 82), 1e-3), Q.IQ4_NL: ((0,), 1e-3), Q.IQ4_XS: ((0,), 5e-5),
    Q.Q8_0: ((0,), 1e-3), Q.Q4_0: ((0,), 1e-2), Q.Q4_1: ((0, 2), 1e-2), Q.Q5_0: ((0,), 5e-3),
    Q.Q5_1: ((0, 2), 5e-3),
}  # fmt: skip


def random_k_blocks(qtype, rows: int, cols: int, gen: np.random.Generator) -> np.ndarray:
    """Raw blocks of a type (gguf-py cannot quantize to most): random values and packed scales,
    small float16 scales so that weights are O(1 / sqrt(cols))."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = gen.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    offsets, spread = K_BLOCK_SCALES[qtype]
    for offset in offsets:
        scale = (gen.standard_normal((rows, cols // block, 1)) * spread).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(rows, -1)


def write_raw_types(path: Path, vocab, raw_types: dict[str, Q], head: Q, seed: int, tied: bool = False
                    ) -> Path:
    """A llama whose projections named in `raw_types` (q_proj, up_proj, ...) and LM head (the
    embedding table, where `tied`) are random raw blocks of those types; every other weight Q8_0."""
    cfg = LlamaConfig(**config_kwargs(vocab[0], 256, 256), tie_word_embeddings=tied)
    model = randomize(LlamaForCausalLM(cfg), seed=seed)
    gen = np.random.default_rng(seed)
    state, extra = {}, {}
    head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for name, tensor in model.state_dict().items():
        kind = name.split(".")[-2]
        if tied and name == "lm_head.weight":
            continue
        if kind in raw_types or name == head_name:
            qtype = raw_types.get(kind, head)
            raw = random_k_blocks(qtype, tensor.shape[0], tensor.shape[1], gen)
            extra[gguf_tensor_name("llama", NUM_LAYERS, name)] = (raw, qtype)
        else:
            state[name] = tensor
    write_gguf(path, "llama", cfg, state, *vocab, tensor_type=Q.Q8_0, extra_tensors=extra)
    return path


def load(path: Path, quantization: str) -> LoadedModel:
    return load_model(str(path), torch.float32, CPU, quantization=quantization)


def dense_weights(path: Path) -> CausalLM:
    """The "none" path's fused weights, before oneDNN packing takes the plain copies away."""
    checkpoint = GGUFCheckpoint(str(path))
    model = CausalLM(ModelConfig.from_hf(checkpoint.hf_config()), 16, TorchOps())
    load_weights(model, checkpoint.weights(torch.float32))
    return model


def logits(loaded: LoadedModel) -> torch.Tensor:
    m, cfg = loaded.model, loaded.config
    m.bind_kv_cache(torch.zeros(cfg.num_layers, 2, 8, 16, cfg.num_kv_heads, cfg.head_dim))
    ids = loaded.tokenizer(PROMPT)["input_ids"]
    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSeq(0, n)])
    with torch.no_grad():
        return m.compute_logits(m(torch.tensor(ids), torch.arange(n), meta))


def linear_names(num_layers: int) -> list[str]:
    return [f"layers.{i}.{name}" for i in range(num_layers) for name in LINEARS] + ["lm_head"]


def assert_dequantizes_to_dense(quantized: CausalLM, dense: CausalLM, types: dict[str, str]) -> None:
    """Every layer in `types` is a QuantizedLinear of that type whose weight is the dense one."""
    for name, weight_type in types.items():
        layer = quantized.get_submodule(name)
        assert layer.weight_type == weight_type, name
        # A ConcatLinear (a fused projection whose parts keep different layouts) holds its rows part by part.
        parts = layer.parts if isinstance(layer, ConcatLinear) else [layer]
        assert all(isinstance(p, (QuantizedLinear, KQuantLinear)) for p in parts), name
        weight = torch.cat([p.dequantize() for p in parts])
        expected = dense.get_submodule(name).weight
        torch.testing.assert_close(weight, expected, rtol=1e-6, atol=1e-7, msg=name)
        dense_bias = dense.get_submodule(name).bias
        if dense_bias is None:
            assert all(p.bias is None for p in parts), name
        else:
            bias = torch.cat([p.bias for p in parts])
            torch.testing.assert_close(bias, dense_bias, rtol=0, atol=0, msg=name)
    # The file's embedding table stays quantized too; looking up every token gives the dense table.
    assert isinstance(quantized.embed_tokens, (QuantizedEmbedding, KQuantEmbedding))
    every_token = torch.arange(dense.config.vocab_size)
    torch.testing.assert_close(quantized.embed_tokens(every_token), dense.embed_tokens.weight, rtol=1e-6,
                               atol=1e-7)  # fmt: skip


def assert_logits_within_bound(ours: torch.Tensor, dense: torch.Tensor, relative: float = LOGITS_BOUND
                               ) -> None:
    assert dense.abs().max() > 1.0  # the model is not degenerate: a misplaced row would show
    bound = relative * dense.abs().max().item()
    torch.testing.assert_close(ours, dense, atol=bound, rtol=0)


def checked_forward(self: QuantizedLinear | KQuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernels' product, checked against PyTorch over the activations quantized as they do."""
    kquant = isinstance(self, KQuantLinear)
    y = (KQUANT_FORWARD if kquant else QUANTIZED_FORWARD)(self, x)
    rows, w = x.reshape(-1, self.in_features).float(), self.dequantize().double()
    if not kquant and self.in_order is not None:  # the kernels take (and quantize) the features in this order
        rows, w = rows[:, self.in_order], w[:, self.in_order]
    xq = quantized_activations(rows, SUPER if kquant else 32)
    bias = 0 if self.bias is None else self.bias.double()
    reference, magnitude = xq @ w.T + bias, xq.abs() @ w.abs().T
    error = (y.reshape(reference.shape).double() - reference).abs()
    assert (error <= 1e-5 * magnitude + 1e-6).all(), f"{self.weight_type}: {error.max().item()}"
    CHECKED.append(self.weight_type)
    return y


QUANTIZED_FORWARD = QuantizedLinear.forward
KQUANT_FORWARD = KQuantLinear.forward
CHECKED: list[str] = []


def checked_logits(loaded: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The model's logits, every quantized layer's product checked on the way."""
    CHECKED.clear()
    with monkeypatch.context() as patch:
        patch.setattr(QuantizedLinear, "forward", checked_forward)
        patch.setattr(KQuantLinear, "forward", checked_forward)
        result = logits(loaded)
    expected = sum(isinstance(m, (QuantizedLinear, KQuantLinear)) for m in loaded.model.modules())
    assert len(CHECKED) == expected > 0
    return result


# --- GGUF files in the types they store --------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_llama_runs_as_stored(tmp_path, vocab, llama, qtype, native_kernels, monkeypatch):
    path = write(tmp_path, vocab, "llama", llama, qtype)
    ours = load(path, "auto")
    assert ours.quantization == qtype.name
    assert ours.kernel_isa == select_ops(CPU).quant_isa
    types = dict.fromkeys(linear_names(NUM_LAYERS), qtype.name)
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, Q.Q5_1], ids=lambda q: q.name)
def test_qwen2_tied_head_is_the_quantized_embedding(
    tmp_path, vocab, qwen2, qtype, native_kernels, monkeypatch
):
    path = write(tmp_path, vocab, "qwen2", qwen2, qtype)
    ours = load(path, "auto")
    assert ours.model.lm_head.weight_type == qtype.name
    # One table in memory: the embedding looks its rows up in the head's own tensors.
    assert ours.model.embed_tokens.qweight.data_ptr() == ours.model.lm_head.qweight.data_ptr()
    types = dict.fromkeys(linear_names(NUM_LAYERS), qtype.name)
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


def test_k_quants_and_mixed_shards(tmp_path, vocab, native_kernels, monkeypatch):
    """K-quant weights (written as raw blocks) keep their super-blocks, fused shards of different
    types too: q, k in Q4_K above v in Q6_K are one KQuantLinear of two parts (one activation
    quantization for both); gate in Q8_0 beside up in Q6_K share no layout, so gate_up is a
    ConcatLinear of a Q8_0 layer and a Q6_K one. Never dequantized to float32."""
    raw_types = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_K, "up_proj": Q.Q6_K,
                 "down_proj": Q.Q6_K}  # fmt: skip
    path = write_raw_types(tmp_path / "k.gguf", vocab, raw_types, Q.Q6_K, seed=13)

    ours = load(path, "auto")
    types = {"lm_head": "Q6_K"}
    for i in range(NUM_LAYERS):
        types |= {f"layers.{i}.self_attn.qkv_proj": "Q4_K+Q6_K", f"layers.{i}.self_attn.o_proj": "Q5_K",
                  f"layers.{i}.mlp.gate_up_proj": "Q8_0+Q6_K",
                  f"layers.{i}.mlp.down_proj": "Q6_K"}  # fmt: skip
        qkv = ours.model.get_submodule(f"layers.{i}.self_attn.qkv_proj")
        assert isinstance(qkv, KQuantLinear)
        assert [tuple(p.shape) for p in qkv.parts] == [((256 + 128) // 16, 1, 2368), (128 // 16, 1, 3392)]
    assert ours.quantization == "Q4_K+Q6_K, Q5_K, Q6_K, Q8_0"
    # The startup line's count: each part a layer in its own type, none float32.
    assert weight_types(ours.model) == {"Q4_K+Q6_K": 2, "Q5_K": 2, "Q8_0": 2, "Q6_K": 5}
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


@pytest.mark.parametrize("head", [Q.Q6_K, Q.Q4_K], ids=lambda q: q.name)
def test_k_quant_tied_table_is_held_once(tmp_path, vocab, head, native_kernels, monkeypatch):
    """Llama-3.2's files: a tied table in a K-quant (llama.cpp's Q4_K_M makes it Q6_K) is the LM
    head's one packed part, which the embedding looks its rows up in."""
    raw_types = {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q4_K, "gate_proj": Q.Q4_K,
                 "up_proj": Q.Q4_K, "down_proj": Q.Q6_K}  # fmt: skip
    path = write_raw_types(tmp_path / "tied.gguf", vocab, raw_types, head, seed=14, tied=True)

    ours = load(path, "auto")
    head_layer, table = ours.model.lm_head, ours.model.embed_tokens
    assert isinstance(head_layer, KQuantLinear) and isinstance(table, KQuantEmbedding)
    assert table.table.data_ptr() == head_layer.parts[0].data_ptr()
    types = {"lm_head": head.name}
    for i in range(NUM_LAYERS):
        types |= {f"layers.{i}.self_attn.qkv_proj": "Q4_K+Q6_K", f"layers.{i}.self_attn.o_proj": "Q4_K",
                  f"layers.{i}.mlp.gate_up_proj": "Q4_K", f"layers.{i}.mlp.down_proj": "Q6_K"}  # fmt: skip
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


KINDS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("mix", [
    {"q_proj": Q.Q4_K, "k_proj": Q.Q4_K, "v_proj": Q.Q6_K, "o_proj": Q.Q5_K, "gate_proj": Q.Q4_K,
     "up_proj": Q.Q4_K, "down_proj": Q.Q6_K},  # as Q4_K_M mixes them, with a Q5_K
    *(dict.fromkeys(KINDS, qtype) for qtype in (Q.Q2_K, Q.Q3_K, Q.IQ4_XS)),
    *(dict.fromkeys(KINDS, qtype) for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.IQ4_NL)),
    # centred codes fused beside codes with mins
    {**dict.fromkeys(KINDS, Q.Q4_1), "k_proj": Q.Q4_0, "down_proj": Q.Q5_0},
], ids=["Q4_K_M-like", "Q2_K", "Q3_K", "IQ4_XS", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
        "Q4_0+Q4_1"])  # fmt: skip
def test_quantized_weights_hold_what_their_file_does(tmp_path, vocab, mix, native_kernels):
    """A file's weights take no more memory than its tensors do on disk, within 5%: every type
    keeps the file's bits a value (the K-quants' 6-bit scales and mins take a byte each; a
    centred code fused beside codes with mins takes a stored min)."""
    path = write_raw_types(tmp_path / "k.gguf", vocab, mix, mix["down_proj"], seed=4, tied=True)
    file_bytes = sum(int(t.n_bytes) for t in GGUFReader(str(path)).tensors)
    assert file_bytes <= load(path, "auto").weight_bytes <= 1.05 * file_bytes


def test_dense_shard_beside_quantized_ones(tmp_path, vocab, llama, native_kernels, monkeypatch):
    """v stored F16 beside q, k in Q4_0: q and k stay one Q4_0 layer, v's rows a dense one."""
    overrides = {f"model.layers.{i}.self_attn.v_proj.weight": Q.F16 for i in range(NUM_LAYERS)}
    path = write(tmp_path, vocab, "llama", llama, Q.Q4_0, type_overrides=overrides)
    ours = load(path, "auto")
    dense = dense_weights(path)
    for i in range(NUM_LAYERS):
        qkv = ours.model.get_submodule(f"layers.{i}.self_attn.qkv_proj")
        assert isinstance(qkv, ConcatLinear)
        q_k, v = qkv.parts
        assert isinstance(q_k, QuantizedLinear) and q_k.weight_type == "Q4_0"
        assert isinstance(v, DenseLinear) and v.weight_type == "float32"
        expected = dense.get_submodule(f"layers.{i}.self_attn.qkv_proj").weight
        torch.testing.assert_close(q_k.dequantize(), expected[: q_k.out_features], rtol=1e-6, atol=1e-7)
    assert ours.quantization == "Q4_0"
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


STORED_TYPES = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


@pytest.mark.parametrize("qtype", STORED_TYPES, ids=lambda q: q.name)
def test_types_gguf_py_cannot_quantize_run_as_stored(tmp_path, vocab, qtype, native_kernels, monkeypatch):
    """Types gguf-py cannot quantize to, every projection and the LM head in `qtype` (raw
    blocks): each runs as stored (the super-block types in their records, IQ4_NL as 4-bit
    codes), dequantizing to what gguf-py computes."""
    kinds = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    path = tmp_path / f"{qtype.name}.gguf"
    write_raw_types(path, vocab, dict.fromkeys(kinds, qtype), qtype, seed=14)

    ours = load(path, "auto")
    assert ours.quantization == qtype.name
    types = dict.fromkeys(linear_names(NUM_LAYERS), qtype.name)
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    bound = K_LOGITS_BOUND if qtype in KQUANT_GGML_TYPES else LOGITS_BOUND
    assert_logits_within_bound(ours_logits, logits(load(path, "none")), bound)


def test_shards_of_different_widths_share_one_layer(tmp_path, vocab, native_kernels, monkeypatch):
    """gate IQ4_NL beside up Q8_0 stack into one 8-bit layer (IQ4_NL's codes widened to their
    levels); q, k IQ4_XS (super-blocks) beside v IQ4_NL (4-bit codes) keep a part each; down Q5_0
    (gguf-py quantizes it)."""
    raw_types = {"q_proj": Q.IQ4_XS, "k_proj": Q.IQ4_XS, "v_proj": Q.IQ4_NL, "o_proj": Q.IQ4_XS,
                 "gate_proj": Q.IQ4_NL}  # fmt: skip
    cfg = LlamaConfig(**config_kwargs(vocab[0], 256, 256), tie_word_embeddings=False)
    model = randomize(LlamaForCausalLM(cfg), seed=15)
    gen = np.random.default_rng(15)
    state, extra = {}, {}
    for name, tensor in model.state_dict().items():
        kind = name.split(".")[-2]
        if kind in raw_types:
            raw = random_k_blocks(raw_types[kind], tensor.shape[0], tensor.shape[1], gen)
            extra[gguf_tensor_name("llama", NUM_LAYERS, name)] = (raw, raw_types[kind])
        else:
            state[name] = tensor
    overrides = {f"model.layers.{i}.mlp.down_proj.weight": Q.Q5_0 for i in range(NUM_LAYERS)}
    path = tmp_path / "mixed8.gguf"
    write_gguf(path, "llama", cfg, state, *vocab, tensor_type=Q.Q8_0, extra_tensors=extra,
               type_overrides=overrides)  # fmt: skip

    ours = load(path, "auto")
    types = {"lm_head": "Q8_0"}
    for i in range(NUM_LAYERS):
        types |= {f"layers.{i}.self_attn.qkv_proj": "IQ4_XS+IQ4_NL",
                  f"layers.{i}.self_attn.o_proj": "IQ4_XS", f"layers.{i}.mlp.gate_up_proj": "IQ4_NL+Q8_0",
                  f"layers.{i}.mlp.down_proj": "Q5_0"}  # fmt: skip
    assert ours.quantization == "IQ4_NL, IQ4_NL+Q8_0, IQ4_XS, Q5_0, Q8_0"
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


def test_q5_1_shards_beside_8_bit_ones_without_mins_share_one_layer(tmp_path, vocab, llama, native_kernels,
                                                                    monkeypatch):
    """As llama.cpp's Q5_K_M writes a model whose rows are not multiples of 256: Q5_1 where it
    falls back from Q5_K, Q8_0 where from Q6_K (v, down). q, k in Q5_1 and v in Q8_0 stay one
    8-bit layer (Q5_1's codes widened, with their mins), v's rows with zero mins; gate and up one
    Q5_1 layer in 5 bits a value."""
    overrides = {f"model.layers.{i}.{name}.weight": Q.Q8_0 for i in range(NUM_LAYERS)
                 for name in ("self_attn.v_proj", "mlp.down_proj")}  # fmt: skip
    path = write(tmp_path, vocab, "llama", llama, Q.Q5_1, type_overrides=overrides)

    ours = load(path, "auto")
    types = {"lm_head": "Q5_1"}
    for i in range(NUM_LAYERS):
        types |= {f"layers.{i}.self_attn.qkv_proj": "Q5_1+Q8_0", f"layers.{i}.self_attn.o_proj": "Q5_1",
                  f"layers.{i}.mlp.gate_up_proj": "Q5_1", f"layers.{i}.mlp.down_proj": "Q8_0"}  # fmt: skip
        qkv = ours.model.get_submodule(f"layers.{i}.self_attn.qkv_proj")
        assert isinstance(qkv, QuantizedLinear) and qkv.mins is not None
        mins = qkv.mins.transpose(1, 2).flatten(0, 1)  # [rows, blocks]
        cfg = llama.config
        v_rows = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
        assert mins[:-v_rows].any() and not mins[-v_rows:].any()
    assert ours.quantization == "Q5_1, Q5_1+Q8_0, Q8_0"
    assert_dequantizes_to_dense(ours.model, dense_weights(path), types)
    ours_logits = checked_logits(ours, monkeypatch)
    assert_logits_within_bound(ours_logits, logits(load(path, "none")))


def test_quantized_weights_take_less_memory(tmp_path, vocab, llama, native_kernels):
    """Q4_1 keeps 20 bytes per 32 weights (5 bits a weight: its float16 scale and min are kept
    as they are) where float32 takes 128: the weights, embedding table included, shrink ~6x (a
    little less with the row padding and the dense norms)."""
    path = write(tmp_path, vocab, "llama", llama, Q.Q4_1)
    dense, ours = load(path, "none"), load(path, "auto")
    assert ours.weight_bytes < dense.weight_bytes / 5.5


def test_engine_reports_quantization(tmp_path, vocab, llama, native_kernels):
    path = write(tmp_path, vocab, "llama", llama, Q.Q4_0)
    engine = LLM(str(path), quantization="auto", num_kv_blocks=8).engine
    info = engine.model_info
    assert (info.quantization, info.kernel_isa) == ("Q4_0", select_ops(CPU).quant_isa)
    assert info.weight_bytes == engine.weight_bytes > 0
    dense = LLM(str(path), quantization="none", num_kv_blocks=8).engine.model_info
    assert (dense.quantization, dense.kernel_isa) == ("none", "none")


# --- int8 / int4 at load ------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_dense_checkpoint_quantized_at_load(tmp_path, scheme, native_kernels, monkeypatch):
    source = make_tiny_model("qwen2", tmp_path, seed=5)  # qkv biases, tied embeddings
    ours, dense = load(tmp_path, scheme), load(tmp_path, "none")
    assert ours.quantization == scheme
    state = source.state_dict()
    for name in linear_names(NUM_LAYERS)[:-1]:
        layer = ours.model.get_submodule(name)
        assert isinstance(layer, QuantizedLinear) and layer.weight_type == scheme, name
    # Rounding to the nearest of 255 (int8) or 16 (int4) levels per 32 weights: at most half a
    # step, max|w| / 254 or (max - min) / 30 <= max|w| / 15 of the whole tensor.
    step = {"int8": 1 / 254, "int4": 1 / 15}[scheme]
    layer0 = ours.model.layers[0].mlp.down_proj
    expected = state["model.layers.0.mlp.down_proj.weight"]
    torch.testing.assert_close(layer0.dequantize(), expected, rtol=0, atol=step * expected.abs().max().item())
    torch.testing.assert_close(ours.model.lm_head.dequantize(), state["model.embed_tokens.weight"], rtol=0,
                               atol=step * state["model.embed_tokens.weight"].abs().max().item())  # fmt: skip
    ours_logits = checked_logits(ours, monkeypatch)
    if scheme == "int8":  # int8 weights err as little as the activations: twice the bound
        assert_logits_within_bound(ours_logits, logits(dense), 2 * LOGITS_BOUND)


# --- what does not fit ---------------------------------------------------------------------------------


def test_unknown_quantization_lists_the_choices():
    with pytest.raises(ValueError, match=r"none, auto, int8, int4.*'fp8'"):
        EngineConfig(quantization="fp8")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_requantizing_a_quantized_gguf_says_why(tmp_path, vocab, llama, scheme):
    path = write(tmp_path, vocab, "llama", llama, Q.Q4_1)
    with pytest.raises(ModelLoadError, match=rf"already stores quantized weights \(Q4_1\).*{scheme}.*auto"):
        load(path, scheme)


def test_dense_gguf_can_be_quantized_at_load(tmp_path, vocab, llama, native_kernels):
    path = write(tmp_path, vocab, "llama", llama, Q.F16)
    assert load(path, "int8").quantization == "int8"
    assert load(path, "auto").quantization == "none"  # auto runs dense weights in --dtype


def test_unsupported_tensor_type_names_the_supported_ones(tmp_path, vocab, llama):
    block = np.zeros((2, 66), dtype=np.uint8)  # two rows of one IQ2_XXS block: 256 weights in 66 bytes
    path = write(tmp_path, vocab, "llama", llama, Q.Q8_0,
                 extra_tensors={"blk.0.ffn_up_exps.weight": (block, Q.IQ2_XXS)})  # fmt: skip
    supported = r"supported: .*Q2_K.*Q4_1.*Q4_K.*Q5_0.*Q5_1.*Q6_K"
    with pytest.raises(UnsupportedModelError, match=rf"ffn_up_exps\.weight.*IQ2_XXS.*{supported}"):
        GGUFCheckpoint(str(path))
