"""`yaie generate`: complete one prompt in this process, streaming the text to stdout."""

from __future__ import annotations

import argparse
import sys

from yaie.cli.engine_args import add_engine_args
from yaie.cli.local_engine import load_engine, stream_text
from yaie.cli.options import positive_int
from yaie.sampling_params import SamplingParams


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    generate = commands.add_parser("generate", help="complete one prompt, streaming to the terminal")
    generate.add_argument("prompt")
    generate.add_argument("--model", help="a .gguf file or HF directory (default: the bundled SmolLM2-135M)")
    generate.add_argument("--max-tokens", type=positive_int, default=256)
    generate.add_argument("--temperature", type=float, default=0.7)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(generate)
    generate.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    engine = load_engine(args)
    prompt = engine.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    for text in stream_text(engine, prompt, params):
        sys.stdout.write(text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
