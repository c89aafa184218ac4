"""Tiny GGUF files for tests, laid out the way llama.cpp's converter lays them out.

Nothing here comes from yaie: tensor names come from gguf-py's own name map, the Q/K row
permutation is llama.cpp's, and the block decoders at the bottom are written from the GGML
block layouts so they can check a dequantizer without being one of the dequantizers under test.
"""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from transformers.convert_slow_tokenizer import bytes_to_unicode

Q = GGMLQuantizationType

CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello world, hello there! "
    "a tiny model reads a tiny file; the file holds the weights and the words. "
    "then the model writes: one two three four five six seven eight nine ten."
)
END_OF_TEXT = "<|endoftext|>"


def byte_level_vocab(num_merges: int) -> tuple[list[str], list[str]]:
    """A GPT-2 style byte-level BPE vocabulary: 256 byte symbols, `num_merges` merges, one control token.

    The merges are learned greedily from CORPUS (most frequent pair, ties broken by the pair itself),
    so the result is deterministic. Returns (tokens in id order, merges as "left right").
    """
    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)]
    words = Counter()
    for i, word in enumerate(CORPUS.split(" ")):
        text = word if i == 0 else " " + word
        words[tuple(spell[b] for b in text.encode("utf-8"))] += 1
    merges: list[str] = []
    for _ in range(num_merges):
        pairs = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        tokens.append(best[0] + best[1])
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    tokens.append(END_OF_TEXT)
    return tokens, merges


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows (half, pair) -> (pair, half), so RoPE pairs are adjacent."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_arch(arch: str) -> gguf.MODEL_ARCH:
    return next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)


def gguf_tensor_name(arch: str, num_layers: int, hf_name: str) -> str:
    """HF parameter name -> GGUF tensor name, via gguf-py's own table."""
    base, suffix = hf_name.rsplit(".", 1)
    mapped = gguf.get_tensor_name_map(_gguf_arch(arch), num_layers).get_name(base)
    if mapped is None:
        raise KeyError(hf_name)
    return f"{mapped}.{suffix}"


def write_gguf(
    path: Path,
    arch: str,
    config,
    state_dict: dict[str, torch.Tensor],
    tokens: list[str],
    merges: list[str],
    tensor_type: GGMLQuantizationType = Q.F32,
    permute_qk: bool | None = None,
    name: str = "tiny test model",
    type_overrides: dict[str, GGMLQuantizationType] | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
    write_vocab_size: bool = True,
) -> Path:
    """Write `state_dict` (HF names) of a Llama-like `config` as a GGUF file for `arch`.

    1-D tensors (norms, biases) stay F32 as llama.cpp keeps them; 2-D weights become `tensor_type`,
    or the type `type_overrides` gives their HF name. Q/K rows (and biases) are permuted for
    llama-arch files, as llama.cpp's converter does (override with `permute_qk`). `extra_tensors`
    are written as given: GGUF name -> (array or raw block bytes, type). Without `write_vocab_size`
    the vocabulary size is only implied by the token list, as in many llama.cpp files.
    """
    permute_qk = arch == "llama" if permute_qk is None else permute_qk
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // heads:  # llama.cpp writes these when the config names a head_dim
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if write_vocab_size:
        writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL if t == END_OF_TEXT else TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index(END_OF_TEXT))
    writer.add_eos_token_id(tokens.index(END_OF_TEXT))

    for hf_name, tensor in state_dict.items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if permute_qk and ".q_proj." in hf_name:
            array = llama_cpp_permute(array, heads)
        elif permute_qk and ".k_proj." in hf_name:
            array = llama_cpp_permute(array, kv_heads)
        qtype = (type_overrides or {}).get(hf_name, tensor_type if array.ndim == 2 else Q.F32)
        writer.add_tensor(
            gguf_tensor_name(arch, config.num_hidden_layers, hf_name), quantize(array, qtype), raw_dtype=qtype
        )
    for tensor_name, (data, qtype) in (extra_tensors or {}).items():
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- A reference dequantizer, from the GGML block layouts -------------------------------------------


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view("<f2").astype(np.float32).reshape(-1)


def reference_dequantize(raw: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes -> float32 array of `shape` (numpy order, last dim contiguous).

    Block layouts (32 weights per block, little-endian):
      Q8_0: f16 scale d, 32 x int8 q                  w = d * q
      Q4_0: f16 d, 16 bytes: q[j] low nibble, q[j+16] high nibble     w = d * (q - 8)
      Q4_1: f16 d, f16 min m, 16 bytes as Q4_0        w = d * q + m
    """
    data = np.asarray(raw).reshape(-1).view(np.uint8)
    if qtype == Q.F32:
        return data.view("<f4").astype(np.float32).reshape(shape)
    if qtype == Q.F16:
        return _f16(data).reshape(shape)
    if qtype == Q.BF16:
        return (data.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)
    block_bytes = {Q.Q8_0: 34, Q.Q4_0: 18, Q.Q4_1: 20}[qtype]
    blocks = data.reshape(-1, block_bytes)
    d = _f16(blocks[:, 0:2])[:, None]
    if qtype == Q.Q8_0:
        q = blocks[:, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(shape)
    packed = blocks[:, 4:] if qtype == Q.Q4_1 else blocks[:, 2:]
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=1).astype(np.float32)
    if qtype == Q.Q4_0:
        return (d * (q - 8.0)).reshape(shape)
    m = _f16(blocks[:, 2:4])[:, None]
    return (d * q + m).reshape(shape)
