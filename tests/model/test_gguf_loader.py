"""The GGUF loader, checked against references that use none of yaie's code.

Each test writes a tiny GGUF itself (tests/model/gguf_writer.py: llama.cpp's Q/K permutation,
gguf-py's quantizers and tensor names, a byte-level BPE tokenizer) and compares what
`yaie.model.loader_gguf` makes of it with:
  * the HF model the file was written from (exact for F32; within quantization error otherwise),
  * transformers' own GGUF reader (its own name map, config mapping and Q/K un-permutation),
  * a block decoder written in gguf_writer.py from the GGML block layouts.
The last matters because transformers dequantizes llama/qwen files with gguf-py, as we do.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, GGUFWriter
from gguf.quants import quantize
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from tests.model.gguf_writer import (
    Q,
    byte_level_vocab,
    gguf_tensor_name,
    llama_cpp_permute,
    reference_dequantize,
    write_gguf,
)
from tests.model.tiny_models import randomize
from yaie.errors import ModelLoadError, UnsupportedModelError
from yaie.model.attention import AttentionMetadata, PrefillSeq
from yaie.model.loader import load_model
from yaie.model.loader_gguf import GGUFCheckpoint

PROMPT = "the quick brown fox jumps over the lazy dog, hello world!"
ALL_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1]
# Largest |dequantized - original| allowed, as a fraction of the tensor's largest |weight|.
QUANT_ERROR = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1e-2, Q.Q4_0: 0.13, Q.Q4_1: 0.07}
CPU = torch.device("cpu")


# --- models and files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vocab() -> tuple[list[str], list[str]]:
    tokens, merges = byte_level_vocab(63)  # 256 bytes + 63 merges + <|endoftext|> = 320 tokens
    assert len(tokens) == 320
    return tokens, merges


def common(tokens: list[str]) -> dict:
    eot = tokens.index("<|endoftext|>")
    return dict(
        vocab_size=len(tokens),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=50000.0,
        bos_token_id=eot,
        eos_token_id=eot,
    )


@pytest.fixture(scope="module")
def llama(vocab) -> LlamaForCausalLM:
    return randomize(LlamaForCausalLM(LlamaConfig(**common(vocab[0]), tie_word_embeddings=False)), seed=1)


@pytest.fixture(scope="module")
def llama_bias(vocab) -> LlamaForCausalLM:
    """HF's attention_bias=True: q, k, v and o projections all have biases."""
    cfg = LlamaConfig(**common(vocab[0]), tie_word_embeddings=False, attention_bias=True)
    return randomize(LlamaForCausalLM(cfg), seed=2)


@pytest.fixture(scope="module")
def llama_qkv_bias(vocab) -> LlamaForCausalLM:
    """q, k, v biases only (the o_proj bias is zero and left out of the file)."""
    cfg = LlamaConfig(**common(vocab[0]), tie_word_embeddings=False, attention_bias=True)
    model = randomize(LlamaForCausalLM(cfg), seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.bias.zero_()
    return model


@pytest.fixture(scope="module")
def qwen2(vocab) -> Qwen2ForCausalLM:
    return randomize(Qwen2ForCausalLM(Qwen2Config(**common(vocab[0]), tie_word_embeddings=True)), seed=3)


@pytest.fixture(scope="module")
def qwen3(vocab) -> Qwen3ForCausalLM:
    # head_dim 32 != hidden / heads: the file must carry attention.key_length.
    cfg = Qwen3Config(**common(vocab[0]), head_dim=32, tie_word_embeddings=False)
    return randomize(Qwen3ForCausalLM(cfg), seed=4)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def write(gguf_dir: Path, vocab, arch: str, model, qtype, tag: str = "", leave_out: str = "", **kw) -> Path:
    path = gguf_dir / f"{arch}{tag}-{qtype.name}.gguf"
    if not path.exists():
        state = {k: v for k, v in model.state_dict().items() if not (leave_out and leave_out in k)}
        write_gguf(path, arch, model.config, state, *vocab, tensor_type=qtype, **kw)
    return path


# --- references ------------------------------------------------------------------------------------


def our_tensors(path: Path) -> dict[str, torch.Tensor]:
    return dict(GGUFCheckpoint(str(path)).weights(torch.float32))


def transformers_from_gguf(path: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """transformers' reading of the file: its config, and its dequantized, renamed tensors in its model.

    Built without `from_pretrained`, which insists on `accelerate` for GGUF files.
    """
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return model, tensors


def prompt_ids(tokenizer) -> list[int]:
    ids = tokenizer(PROMPT)["input_ids"]
    assert 10 <= len(ids) <= 64
    return ids


def our_logits(path: Path) -> tuple[torch.Tensor, list[int]]:
    loaded = load_model(str(path), torch.float32, CPU)
    m, cfg = loaded.model, loaded.config
    m.bind_kv_cache(torch.zeros(cfg.num_layers, 2, 8, 16, cfg.num_kv_heads, cfg.head_dim))
    ids = prompt_ids(loaded.tokenizer)
    T = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(T), prefills=[PrefillSeq(0, T)])
    with torch.no_grad():
        return m.compute_logits(m(torch.tensor(ids), torch.arange(T), meta)), ids


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert ref.abs().max() > 1.0  # the models are not degenerate: a wrong weight would show
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def assert_same_tensors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(ref)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        torch.testing.assert_close(tensor, ref[name].float(), atol=1e-6, rtol=0, msg=name)


def assert_near_source(ours: dict[str, torch.Tensor], source: torch.nn.Module, qtype) -> None:
    """Our tensors are the source model's, to within the quantization error (exactly, for F32)."""
    state = source.state_dict()
    if source.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {k: v for k, v in state.items() if not k.endswith(("rotary_emb.inv_freq", "o_proj.bias"))}
    assert sorted(ours) == sorted(state)
    for name, tensor in ours.items():
        expected = state[name].float()
        # llama.cpp keeps 1-D tensors in F32
        bound = 0.0 if expected.ndim == 1 else QUANT_ERROR[qtype] * expected.abs().max().item()
        torch.testing.assert_close(tensor, expected, atol=bound, rtol=0, msg=name)


# --- llama: every tensor type -----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_llama_tensors_match_transformers_and_source(gguf_dir, vocab, llama, qtype):
    path = write(gguf_dir, vocab, "llama", llama, qtype)
    ours = our_tensors(path)
    _, theirs = transformers_from_gguf(path)
    assert_same_tensors(ours, theirs)
    assert_near_source(ours, llama, qtype)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_llama_dequantization_matches_block_layout(gguf_dir, vocab, llama, qtype):
    """Decode every tensor's raw bytes with our own block decoder; permute ours back the llama.cpp way."""
    path = write(gguf_dir, vocab, "llama", llama, qtype)
    ours = our_tensors(path)
    cfg = llama.config
    by_gguf_name = {gguf_tensor_name("llama", cfg.num_hidden_layers, n): t for n, t in ours.items()}
    reader = GGUFReader(str(path))
    assert {t.name for t in reader.tensors} == set(by_gguf_name)
    for t in reader.tensors:
        expected_type = qtype if len(t.shape) == 2 else Q.F32
        assert t.tensor_type == expected_type, t.name
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        decoded = reference_dequantize(t.data, t.tensor_type, shape)
        mine = by_gguf_name[t.name].numpy()
        if ".attn_q." in t.name:
            mine = llama_cpp_permute(mine, cfg.num_attention_heads)
        elif ".attn_k." in t.name:
            mine = llama_cpp_permute(mine, cfg.num_key_value_heads)
        np.testing.assert_allclose(mine, decoded, rtol=1e-6, atol=1e-7, err_msg=t.name)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda q: q.name)
def test_llama_logits_match_transformers(gguf_dir, vocab, llama, qtype):
    path = write(gguf_dir, vocab, "llama", llama, qtype)
    ours, ids = our_logits(path)
    theirs, _ = transformers_from_gguf(path)
    assert_logits_close(ours, hf_logits(theirs, ids))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1], ids=lambda q: q.name)
def test_llama_logits_match_transformers_from_pretrained(gguf_dir, vocab, llama, qtype):
    """The same, through transformers' public GGUF entry point (which needs `accelerate`)."""
    pytest.importorskip("accelerate", reason="transformers loads GGUF models only with accelerate installed")
    path = write(gguf_dir, vocab, "llama", llama, qtype)
    ours, ids = our_logits(path)
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    assert_logits_close(ours, hf_logits(theirs.eval(), ids))


def test_llama_f32_is_the_original_model(gguf_dir, vocab, llama):
    """F32 round trip: the un-permuted tensors are bit-identical to the HF weights, logits match HF."""
    path = write(gguf_dir, vocab, "llama", llama, Q.F32)
    ours = our_tensors(path)
    state = llama.state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, state[name]), name
    logits, ids = our_logits(path)
    assert_logits_close(logits, hf_logits(llama, ids))


def test_llama_hf_config_agrees_with_transformers(gguf_dir, vocab, llama):
    path = write(gguf_dir, vocab, "llama", llama, Q.Q8_0)
    ours = GGUFCheckpoint(str(path)).hf_config()
    theirs = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    src = llama.config
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == getattr(theirs, key) == getattr(src, key), key
    assert ours["rms_norm_eps"] == pytest.approx(src.rms_norm_eps)
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"] == 50000.0
    assert ours["attention_bias"] is False


def test_the_checkpoint_does_not_keep_the_vocabulary(gguf_dir, vocab, llama):
    """The vocabulary's arrays are the tokenizer's (transformers reads them from the file): kept
    through loading they fragmented Python's allocator (benchmarks/results/DIARY.md, "Found on
    the way"). The size they imply is still known where the file does not state it."""
    path = write(gguf_dir, vocab, "llama", llama, Q.Q8_0, tag="-no-vocab-size", write_vocab_size=False)
    checkpoint = GGUFCheckpoint(str(path))
    kept = [key for key in checkpoint.reader.fields if key.startswith("tokenizer.ggml.")]
    assert "tokenizer.ggml.tokens" in GGUFReader(str(path)).fields
    assert "tokenizer.ggml.tokens" not in kept and "tokenizer.ggml.merges" not in kept
    assert "tokenizer.ggml.eos_token_id" in kept  # single values stay: the config reads them
    assert checkpoint.hf_config()["vocab_size"] == len(vocab[0]) == llama.config.vocab_size


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=lambda q: q.name)
def test_llama_with_qkv_bias(gguf_dir, vocab, llama_qkv_bias, qtype):
    """llama.cpp permutes Q/K biases like the weights. transformers drops llama biases from GGUF
    (its config mapping has no attention_bias), so the reference here is the source model."""
    path = write(gguf_dir, vocab, "llama", llama_qkv_bias, qtype, tag="-qkvbias", leave_out="o_proj.bias")
    ours = our_tensors(path)
    assert GGUFCheckpoint(str(path)).hf_config()["attention_bias"] is True
    assert_near_source(ours, llama_qkv_bias, qtype)
    if qtype == Q.F32:
        logits, ids = our_logits(path)
        assert_logits_close(logits, hf_logits(llama_qkv_bias, ids))


def test_llama_output_bias_is_loaded_or_refused(gguf_dir, vocab, llama_bias):
    """A llama file with `attn_output.bias` (HF attention_bias=True biases o_proj too) must either
    load with that bias applied or be refused; dropping it silently gives wrong logits."""
    path = write(gguf_dir, vocab, "llama", llama_bias, Q.F32, tag="-bias")
    assert "blk.0.attn_output.bias" in {t.name for t in GGUFReader(str(path)).tensors}
    try:
        logits, ids = our_logits(path)
    except ModelLoadError:  # UnsupportedModelError included
        return
    assert_logits_close(logits, hf_logits(llama_bias, ids))


# --- qwen2 and qwen3: no permutation ---------------------------------------------------------------


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0], ids=lambda q: q.name)
def test_qwen2_matches_transformers(gguf_dir, vocab, qwen2, qtype):
    """qkv biases, tied embeddings, rows not permuted, no qwen2.vocab_size key."""
    path = write(gguf_dir, vocab, "qwen2", qwen2, qtype, write_vocab_size=False)
    cfg = GGUFCheckpoint(str(path)).hf_config()
    assert cfg["vocab_size"] == len(vocab[0])  # from the token list
    assert cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["attention_bias"] is True
    assert cfg["tie_word_embeddings"] is True
    ours = our_tensors(path)
    model, theirs = transformers_from_gguf(path)
    assert_same_tensors(ours, theirs)
    assert_near_source(ours, qwen2, qtype)
    logits, ids = our_logits(path)
    assert_logits_close(logits, hf_logits(model, ids))
    if qtype == Q.F32:
        assert_logits_close(logits, hf_logits(qwen2, ids))


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q4_1], ids=lambda q: q.name)
def test_qwen3_matches_source(gguf_dir, vocab, qwen3, qtype):
    """q/k norms, head_dim from attention.key_length. transformers' qwen3 GGUF config mapping
    ignores key_length (it would build head_dim 128), so the reference is the source model."""
    path = write(gguf_dir, vocab, "qwen3", qwen3, qtype)
    cfg = GGUFCheckpoint(str(path)).hf_config()
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["head_dim"] == 32
    ours = our_tensors(path)
    assert_near_source(ours, qwen3, qtype)
    if qtype == Q.F32:
        logits, ids = our_logits(path)
        assert_logits_close(logits, hf_logits(qwen3, ids))


# --- what we refuse --------------------------------------------------------------------------------


def test_unsupported_architecture_is_named(tmp_path):
    path = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(path), "phi3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="phi3"):
        GGUFCheckpoint(str(path))
    with pytest.raises(UnsupportedModelError, match="phi3"):
        load_model(str(path), torch.float32, CPU)


def test_unsupported_tensor_type_tq1_0(tmp_path, vocab, llama):
    # A type gguf-py quantizes (TQ1_0: 256 values a block, so a [256, 256] weight) that yaie does
    # not run: the file names the tensor and its type.
    signs = np.sign(np.random.default_rng(0).standard_normal((256, 256))).astype(np.float32)
    extra = {"blk.1.ffn_down_exps.weight": (quantize(signs, Q.TQ1_0), Q.TQ1_0)}
    path = write(tmp_path, vocab, "llama", llama, Q.Q8_0, extra_tensors=extra)
    with pytest.raises(UnsupportedModelError, match=r"blk\.1\.ffn_down_exps\.weight.*TQ1_0"):
        GGUFCheckpoint(str(path))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q5_1], ids=lambda q: q.name)
def test_q5_types_load_as_gguf_dequantizes_them(tmp_path, vocab, llama, qtype):
    """Q5_0 and Q5_1, once refused, load (dense here, as gguf-py dequantizes; kept quantized in
    tests/model/test_quantized_model.py)."""
    path = write(tmp_path, vocab, "llama", llama, Q.Q8_0,
                 type_overrides={"model.layers.1.mlp.down_proj.weight": qtype})  # fmt: skip
    weights = dict(GGUFCheckpoint(str(path)).weights(torch.float32))
    expected = llama.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert weights["model.layers.1.mlp.down_proj.weight"].shape == expected.shape
    # Q5_0's step is max|w| / 16 per 32 values; rounding is within half a step, but -max clips to
    # 15 steps below zero: within one step (and float16's rounding of the step). Q5_1's step is
    # (max - min) / 31 from the block's min: within half a step, and float16's rounding of the
    # step and the min, so within one step too.
    blocks = expected.view(expected.shape[0], -1, 32)
    if qtype == Q.Q5_0:
        step = blocks.abs().amax(-1, keepdim=True) / 16
    else:
        step = (blocks.amax(-1, keepdim=True) - blocks.amin(-1, keepdim=True)) / 31
    error = (weights["model.layers.1.mlp.down_proj.weight"] - expected).abs().view_as(blocks)
    assert bool((error <= step * 1.01).all())


def test_unsupported_tensor_type_iq2_xxs(tmp_path, vocab, llama):
    # gguf-py cannot quantize to IQ2_XXS; the loader refuses on the type alone, so zeroed blocks do.
    # One IQ2_XXS block is 256 weights in 66 bytes.
    block = np.zeros((2, 66), dtype=np.uint8)
    extra = {"blk.0.ffn_gate_exps.weight": (block, Q.IQ2_XXS)}
    path = write(tmp_path, vocab, "llama", llama, Q.F32, extra_tensors=extra)
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        GGUFCheckpoint(str(path))


def test_llama31_rope_factors_are_refused(tmp_path, vocab, llama):
    factors = np.ones(8, dtype=np.float32)
    path = write(
        tmp_path, vocab, "llama", llama, Q.F32, extra_tensors={"rope_freqs.weight": (factors, Q.F32)}
    )
    with pytest.raises(UnsupportedModelError, match="rope"):
        GGUFCheckpoint(str(path)).hf_config()
