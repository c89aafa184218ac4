"""GGUF files at the sizes people run, made the way people's files are made: a random-weight model
with a published architecture's shapes, converted by llama.cpp's own `convert_hf_to_gguf.py` and
quantized by its own `llama-quantize`.

    python benchmarks/make_gguf.py [--shape llama-3.2-1b] [--types Q4_K_M Q5_K_M ...]
        [--out ~/.cache/yaie/gguf] [--peers /tmp/peers]

No machine here reaches the Hugging Face hub, so the weights are random (as transformers initializes
them: normal with std initializer_range, 0.02, for the linear and embedding weights, ones for the
RMSNorm weights) and the tokenizer is the bundled SmolLM2's (llama.cpp's converter knows it; the
converter pads the vocabulary to the shape's with unused tokens). Speed does not depend on the
weights' values: every kernel reads every byte. The checkpoint is never a model in memory (an 8B
in fp32 is 32 GB): each tensor's name and shape come from `LlamaForCausalLM` built on the meta
device, and the tensors are drawn and written one bf16 safetensors shard (at most 2 GB) at a time,
with the `model.safetensors.index.json` transformers writes. `llama-quantize` chooses each
tensor's type by its own rules (Q4_K_M keeps some attn_v and ffn_down in Q6_K and the tied table
in Q6_K), which is what makes these files like the downloaded ones.

Needs llama.cpp built by benchmarks/peers/install_llamacpp.sh (its tree has the converter).
Writes OUT/<shape>-<TYPE>.gguf (and the F16 file it quantizes from, and the checkpoint
OUT/<shape>-hf it converts); existing files are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from yaie.model.loader import bundled_model_path, load_tokenizer

# Published configs (their config.json's shape fields): the models our users bring.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
    ),
    "llama-3.2-3b": dict(
        hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0,
    ),
    "llama-3.1-8b": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
}  # fmt: skip

# The most bytes of one safetensors shard: what `hf_model` holds in memory at once.
SHARD_BYTES = 2 * 10**9


def _shards(config: LlamaConfig) -> list[list[tuple[str, torch.Size, bool]]]:
    """The checkpoint's tensors, (name, shape, is a norm's weight), in `LlamaForCausalLM`'s order and
    cut into shards of at most SHARD_BYTES in bf16 (a bigger tensor gets a shard of its own).

    Read off the model built on the meta device, so nothing is allocated; the tied `lm_head.weight`
    is left out, as `save_pretrained` leaves it out."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    init: dict[str, bool] = {}  # parameter name -> ones (a norm) rather than normal(0, initializer_range)
    for prefix, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            init[f"{prefix}.weight"] = False
        elif "RMSNorm" in type(module).__name__:
            init[f"{prefix}.weight"] = True
    shards: list[list[tuple[str, torch.Size, bool]]] = [[]]
    size = 0
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in init:
            raise ValueError(f"{name}: no init rule for {tuple(tensor.shape)} (a new module type?)")
        nbytes = tensor.numel() * 2
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor.shape, init[name]))
        size += nbytes
    return shards


def hf_model(shape: str, out_dir: Path) -> Path:
    """The random-weight HF checkpoint of `shape` with the bundled tokenizer, written one tensor at a
    time into bf16 safetensors shards (with the index `save_pretrained` writes): peak memory is one
    shard, not the model (an 8B in fp32 would be 32 GB)."""
    if (out_dir / "config.json").exists():
        return out_dir
    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, max_position_embeddings=131072,
                         dtype="bfloat16", architectures=["LlamaForCausalLM"])  # fmt: skip
    shards = _shards(config)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    generator = torch.Generator().manual_seed(0)
    std = config.initializer_range
    weight_map: dict[str, str] = {}
    total_size = total_parameters = 0
    for i, names in enumerate(shards, 1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, size, is_norm in names:
            tensor = torch.empty(size, dtype=torch.bfloat16)
            tensors[name] = tensor.fill_(1.0) if is_norm else tensor.normal_(0.0, std, generator=generator)
            weight_map[name] = filename
            total_size += tensor.numel() * 2
            total_parameters += tensor.numel()
        save_file(tensors, str(staging / filename), metadata={"format": "pt"})
        del tensors
    metadata = {"total_parameters": total_parameters, "total_size": total_size}
    index = {"metadata": metadata, "weight_map": weight_map}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    load_tokenizer(bundled_model_path()).save_pretrained(str(staging))
    staging.rename(out_dir)
    return out_dir


def llama_gguf_files(
    tree: Path, out: Path, stem: str, types: Iterable[str], hf_dir: Callable[[], Path]
) -> dict[str, Path]:
    """OUT/<stem>-F16.gguf, converted by llama.cpp's converter (in `tree`) from the HF checkpoint
    `hf_dir()` returns, and OUT/<stem>-<TYPE>.gguf quantized from it by `llama-quantize`, for each
    of `types`: {"F16": path, type: path, ...}. Existing files are kept (`hf_dir` is then not called)."""
    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{stem}-F16.gguf"
    if not f16.exists():
        convert = [sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir())]
        subprocess.run([*convert, "--outtype", "f16", "--outfile", str(f16)], check=True)
    files = {"F16": f16}
    quantize, threads = tree / "build/bin/llama-quantize", str(torch.get_num_threads())
    for name in types:
        files[name] = path = out / f"{stem}-{name}.gguf"
        if not path.exists():
            subprocess.run([str(quantize), str(f16), str(path), name, threads], check=True)
    return files


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--types", nargs="+", default=["Q4_K_M"], help="llama-quantize's type names")
    parser.add_argument("--out", type=Path, default=Path.home() / ".cache/yaie/gguf")
    parser.add_argument("--peers", type=Path, default=Path(os.environ.get("PEERS_DIR", "/tmp/peers")))
    args = parser.parse_args()

    tree = args.peers / "llama.cpp"
    quantize = tree / "build/bin/llama-quantize"
    if not quantize.exists():
        print(f"{quantize} is missing: run benchmarks/peers/install_llamacpp.sh first", file=sys.stderr)
        return 1
    files = llama_gguf_files(tree, args.out, args.shape, args.types,
                             lambda: hf_model(args.shape, args.out / f"{args.shape}-hf"))  # fmt: skip
    for name in args.types:
        print(f"{files[name]}  {files[name].stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
