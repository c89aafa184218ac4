"""Write a plain fp32 Hugging Face copy of a GGUF model, for engines that read HF directories.

    python benchmarks/dense_copy.py [--gguf PATH] [--out DIR] [--force] [--verify]

transformers' own GGUF loader takes 25-40 s on this model; our GGUFCheckpoint dequantizes the
same tensors in a few seconds. The copy holds config.json, generation_config.json, an fp32
model.safetensors and the tokenizer files, so `AutoModelForCausalLM.from_pretrained(out)` (and
vLLM) load it directly. An existing complete copy is reused unless --force is given.

--verify loads the copy with transformers and checks its greedy output against the reference
in ../shared/reference/hf_greedy.json (produced by transformers from the GGUF itself).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from yaie.model.loader import bundled_model_path, load_tokenizer
from yaie.model.loader_gguf import GGUFCheckpoint

DEFAULT_OUT = Path.home() / ".cache" / "yaie" / "dense" / "SmolLM2-135M-Instruct"
DEFAULT_REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "hf_greedy.json"
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json")


def is_complete(out_dir: Path) -> bool:
    return all((out_dir / name).is_file() for name in REQUIRED_FILES)


def hf_llama_config(gguf_config: dict[str, Any]) -> dict[str, Any]:
    """Our GGUF reader's config dict, completed into what transformers writes for a Llama."""
    if gguf_config["architectures"] != ["LlamaForCausalLM"]:
        raise ValueError(f"only Llama GGUFs are supported here, got {gguf_config['architectures']}")
    config = dict(gguf_config)
    config.update(
        model_type="llama",
        hidden_act="silu",
        mlp_bias=False,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        pretraining_tp=1,
        pad_token_id=config["eos_token_id"],
        dtype="float32",
    )
    return config


def make_dense_copy(gguf_path: Path, out_dir: Path, force: bool = False) -> Path:
    """Write an fp32 HF checkpoint of `gguf_path` into `out_dir` (reused if already complete)."""
    from transformers import GenerationConfig, LlamaConfig

    out_dir = out_dir.expanduser()
    if is_complete(out_dir) and not force:
        return out_dir
    checkpoint = GGUFCheckpoint(str(gguf_path))
    config = LlamaConfig(**hf_llama_config(checkpoint.hf_config()))
    tensors = {name: tensor.contiguous() for name, tensor in checkpoint.weights(torch.float32)}
    tokenizer = load_tokenizer(gguf_path)

    # Build beside the destination, then rename: a reader never sees a half-written copy.
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        staging.chmod(0o755)  # mkdtemp makes it private; the copy is meant to be shared
        config.save_pretrained(staging)
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.eos_token_id,
        ).save_pretrained(staging)
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(staging))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out_dir


def verify(out_dir: Path, reference_file: Path) -> bool:
    """Greedy-decode the reference prompts with transformers from `out_dir`; True if all match."""
    from transformers import AutoModelForCausalLM

    reference = json.loads(reference_file.read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    model.eval()
    all_match = True
    for case in reference["results"]:
        expected = case["generated_ids"]
        input_ids = torch.tensor([case["prompt_ids"]])
        with torch.inference_mode():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=32,
                eos_token_id=reference["eos_token_id"],
                pad_token_id=reference["eos_token_id"],
            )
        got = output[0, input_ids.shape[1] :].tolist()
        match = got == expected
        all_match &= match
        print(f"{'ok      ' if match else 'MISMATCH'} {case['kind']:4} {case['prompt']!r}")
        if not match:
            print(f"    expected {expected}\n    got      {got}")
    return all_match


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the bundled model)")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})"
    )
    parser.add_argument("--force", action="store_true", help="rewrite the copy even if it is complete")
    parser.add_argument("--verify", action="store_true", help="check transformers' greedy output on it")
    parser.add_argument("--reference", type=Path, default=DEFAULT_REFERENCE, help="greedy reference JSON")
    args = parser.parse_args()

    gguf_path = args.gguf or bundled_model_path()
    reused = is_complete(args.out.expanduser()) and not args.force
    start = time.perf_counter()
    out_dir = make_dense_copy(gguf_path, args.out, force=args.force)
    action = "reused" if reused else f"wrote in {time.perf_counter() - start:.1f} s"
    print(f"dense copy of {gguf_path.name}: {out_dir} ({action})")
    if args.verify and not verify(out_dir, args.reference):
        print("greedy output differs from the reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
