"""GGUF files (llama.cpp's format) -> a HF-style config dict and HF-named float tensors.

Translating into HF names and layouts here keeps the model code format-agnostic. Two things
differ from a HF checkpoint beyond names:
  * llama.cpp stores Q and K projection rows of Llama models permuted so that its RoPE can
    rotate adjacent pairs; HF rotates the two halves of each head. We undo the permutation.
  * weights may be quantized (Q8_0, Q4_K, Q6_K, ...: gguf_blocks.SUPPORTED_GGML_TYPES): the `gguf` package
    dequantizes them, or, where the caller keeps them quantized, they come out as
    `QuantizedWeight` (raw blocks; the Q/K un-permutation moves whole rows, so it applies to
    the unpacked rows just the same).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from yaie.errors import UnsupportedModelError
from yaie.model.gguf_blocks import SUPPORTED_GGML_TYPES, kquant_fields, unpack_gguf
from yaie.ops.kquant_layout import KQuantFields
from yaie.ops.quant_layout import Unpacked

# llama.cpp writes Mistral models as "llama".
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# Architectures whose Q/K rows llama.cpp's converter permutes.
PERMUTED_QK = {"llama"}

DENSE_TYPES = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}
SUPPORTED_TENSOR_TYPES = DENSE_TYPES | set(SUPPORTED_GGML_TYPES)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class _PlainArrayReader(GGUFReader):
    """GGUFReader over a plain ndarray view of the file's memory map.

    Every slice of an np.memmap runs memmap.__array_finalize__; parsing the ~100k vocabulary
    strings of a typical GGUF makes that the bulk of load time (seconds). A plain view of the
    same mapping parses identically, several times faster, and still reads tensors lazily.
    """

    @property  # type: ignore[override]  # a plain array, where the base says memmap
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._data = value.view(np.ndarray)


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name.startswith("blk."):
        index, rest = gguf_name[4:].split(".", 1)
        if rest in _LAYER_NAMES:
            return f"model.layers.{index}.{_LAYER_NAMES[rest]}"
    return None


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: rows (head, pair, 2) -> (head, 2, pair)."""
    rows = weight.shape[0]
    unpermuted: np.ndarray = (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
    return unpermuted


@dataclass(frozen=True)
class QuantizedWeight:
    """A 2-D weight left in its GGUF block format: the raw blocks of [out_features, in_features]
    and, for llama.cpp's permuted Q/K rows, the head count to un-permute them by."""

    data: np.ndarray
    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    permuted_heads: int | None

    def unpacked(self) -> Unpacked:
        """Values and scales in HF row order."""
        u = unpack_gguf(self.data, self.ggml_type, *self.shape)
        if self.permuted_heads is None:
            return u
        heads = self.permuted_heads
        mins = None if u.mins is None else unpermute_qk(u.mins, heads)
        return Unpacked(unpermute_qk(u.values, heads), unpermute_qk(u.scales, heads), mins, u.bits, u.levels)

    def kquant_fields(self) -> KQuantFields:
        """A K-quant weight's super-block fields in HF row order."""
        f = kquant_fields(self.data, self.ggml_type, *self.shape)
        if self.permuted_heads is None:
            return f
        heads = self.permuted_heads

        def rows(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else unpermute_qk(a, heads)

        return KQuantFields(f.type_name, unpermute_qk(f.values, heads), unpermute_qk(f.scales, heads),
                            rows(f.mins), unpermute_qk(f.d, heads), rows(f.dmin))  # fmt: skip

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return _dense(self.data, self.ggml_type, self.permuted_heads, dtype)


def _dense(data: np.ndarray, ggml_type: GGMLQuantizationType, permuted_heads: int | None,
           dtype: torch.dtype) -> torch.Tensor:
    array = dequantize(data, ggml_type)
    if permuted_heads is not None:
        array = unpermute_qk(array, permuted_heads)
    return torch.from_numpy(np.array(array, dtype=np.float32, copy=True)).to(dtype)


class GGUFCheckpoint:
    def __init__(self, path: str) -> None:
        self.reader = _PlainArrayReader(path)
        self.arch = self._field("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            supported = ", ".join(GGUF_ARCHITECTURES)
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported; yaie reads {supported}"
            )
        fields = self.reader.fields
        tokens = fields.get("tokenizer.ggml.tokens")
        self._vocab_len = None if tokens is None else len(tokens.data)
        # The vocabulary's arrays (tokens, merges, scores: ~100k small numpy arrays, ~60 MiB of
        # Python objects) are the tokenizer's, and transformers reads them from the file itself.
        # Dropped now, before anything else is allocated among them: freed only with the reader,
        # at the end of loading, they left Python's allocator holding ~60 MiB of arenas, each
        # kept by a few objects made meanwhile, for the life of the server.
        for key in [k for k, f in fields.items() if k.startswith("tokenizer.ggml.") and len(f.data) > 1]:
            del fields[key]
        self.tensors = {t.name: t for t in self.reader.tensors}
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TENSOR_TYPES:
                supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
                raise UnsupportedModelError(
                    f"GGUF tensor {t.name} has unsupported type {t.tensor_type.name} (supported: {supported})"
                )
            # A tensor we cannot place (MoE experts, exotic biases) would silently change the model.
            if hf_tensor_name(t.name) is None and t.name != "rope_freqs.weight":
                raise UnsupportedModelError(f"GGUF tensor {t.name} is not supported")

    @property
    def num_tensors(self) -> int:
        return len(self.tensors)

    def _field(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def hf_config(self) -> dict[str, Any]:
        a = self.arch
        heads = self._field(f"{a}.attention.head_count")
        hidden = self._field(f"{a}.embedding_length")
        vocab = self._field(f"{a}.vocab_size") or self._vocab_len
        cfg: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[a]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._field(f"{a}.feed_forward_length"),
            "num_hidden_layers": self._field(f"{a}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._field(f"{a}.attention.head_count_kv", heads),
            "head_dim": self._field(f"{a}.attention.key_length", hidden // heads),
            "rms_norm_eps": self._field(f"{a}.attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._field(f"{a}.rope.freq_base", 10000.0),
            "max_position_embeddings": self._field(f"{a}.context_length", 4096),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }
        scaling = self._field(f"{a}.rope.scaling.type")
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": self._field(f"{a}.rope.scaling.factor")}
        elif scaling not in (None, "none"):
            raise UnsupportedModelError(f"GGUF rope scaling {scaling!r} is not supported")
        if "rope_freqs.weight" in self.tensors:
            raise UnsupportedModelError(
                "GGUF files with per-frequency rope factors (llama3.1) are not supported"
            )
        return cfg

    @property
    def quantized_types(self) -> set[GGMLQuantizationType]:
        """The block formats the file's 2-D weights are stored in."""
        return {t.tensor_type for t in self.reader.tensors if len(t.shape) == 2} - DENSE_TYPES

    def weights(self, dtype: torch.dtype, keep_quantized: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """HF-named tensors, dequantized to `dtype`; with `keep_quantized`, 2-D weights in a
        format the quantized kernels run come out as `QuantizedWeight` instead."""
        cfg = self.hf_config()
        for name, tensor in self.tensors.items():
            hf_name = hf_tensor_name(name)
            if hf_name is None:
                continue
            heads = None
            if self.arch in PERMUTED_QK and name.endswith(("attn_q.weight", "attn_q.bias")):
                heads = cfg["num_attention_heads"]
            elif self.arch in PERMUTED_QK and name.endswith(("attn_k.weight", "attn_k.bias")):
                heads = cfg["num_key_value_heads"]
            if keep_quantized and tensor.tensor_type in SUPPORTED_GGML_TYPES and len(tensor.shape) == 2:
                # GGUF lists dimensions innermost first: [in_features, out_features].
                shape = (int(tensor.shape[1]), int(tensor.shape[0]))
                yield hf_name, QuantizedWeight(tensor.data, tensor.tensor_type, shape, heads)
            else:
                yield hf_name, _dense(tensor.data, tensor.tensor_type, heads, dtype)
