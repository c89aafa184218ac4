"""GGUF files at the sizes people run, made the way people's files are made: a random-weight model
with a published architecture's shapes, converted by llama.cpp's own `convert_hf_to_gguf.py` and
quantized by its own `llama-quantize`.

    python benchmarks/make_gguf.py [--shape llama-3.2-1b] [--types Q4_K_M Q5_K_M ...]
        [--out ~/.cache/yaie/gguf] [--peers /tmp/peers]

No machine here reaches the Hugging Face hub, so the weights are random (normal, std 0.02, as
transformers initializes them) and the tokenizer is the bundled SmolLM2's (llama.cpp's converter
knows it; the converter pads the vocabulary to the shape's with unused tokens). Speed does not
depend on the weights' values: every kernel reads every byte. `llama-quantize` chooses each
tensor's type by its own rules (Q4_K_M keeps some attn_v and ffn_down in Q6_K and the tied table
in Q6_K), which is what makes these files like the downloaded ones.

Needs llama.cpp built by benchmarks/peers/install_llamacpp.sh (its tree has the converter).
Writes OUT/<shape>-<TYPE>.gguf (and the F16 file it quantizes from); existing files are kept.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from yaie.model.loader import bundled_model_path, load_tokenizer

# Published configs (their config.json's shape fields): the models our users bring.
SHAPES: dict[str, dict[str, object]] = {
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


def hf_model(shape: str, out_dir: Path) -> Path:
    """The random-weight HF checkpoint of `shape` (bf16 safetensors) with the bundled tokenizer."""
    if (out_dir / "config.json").exists():
        return out_dir
    config = LlamaConfig(**SHAPES[shape], rms_norm_eps=1e-5, max_position_embeddings=131072,
                         torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    model.save_pretrained(staging)
    load_tokenizer(bundled_model_path()).save_pretrained(str(staging))
    staging.rename(out_dir)
    return out_dir


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
    args.out.mkdir(parents=True, exist_ok=True)
    f16 = args.out / f"{args.shape}-F16.gguf"
    if not f16.exists():
        hf_dir = hf_model(args.shape, args.out / f"{args.shape}-hf")
        subprocess.run([sys.executable, str(tree / "convert_hf_to_gguf.py"), str(hf_dir), "--outtype", "f16",
                        "--outfile", str(f16)], check=True)  # fmt: skip
    threads = str(torch.get_num_threads())
    for name in args.types:
        path = args.out / f"{args.shape}-{name}.gguf"
        if not path.exists():
            subprocess.run([str(quantize), str(f16), str(path), name, threads], check=True)
        print(f"{path}  {path.stat().st_size / 1e6:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
