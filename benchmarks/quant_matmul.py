"""The quantized matmul against the fp32 linear it replaces, at SmolLM2-135M's shapes, in one run.

    python benchmarks/quant_matmul.py [--threads 2] [--rows 1 8 32 512] [--min-time 0.3]
        [--shapes smollm2|llama-1b] [--types Q4_0 Q5_0 ...]

For each weight (K -> N, GGUF type as the bundled Q4_1 file stores it, or each of `--types`;
`--shapes llama-1b`: Llama-3.2-1B's linears, the LM head aside) and each number of
activation rows M, two ways to compute y = x @ W.T:
  * int8:  the activations quantized to int8, integer dot products (yaie/ops/native_ops.py's kernel,
           in the best ISA path here, or YAIE_QUANT_ISA's);
  * fp32:  F.linear on the dequantized fp32 weight, packed for oneDNN as yaie/model/linear.py
           does (`--quantization none`).
The table gives the median ms per call and fp32's time over int8's (> 1: faster than fp32).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from bench_utils import background_cores, cpu_sample, machine_info, make_console, write_report
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from rich.table import Table

from yaie.model.gguf_blocks import unpack_gguf
from yaie.model.linear import DenseLinear
from yaie.model.quantized_linear import QuantizedLinear
from yaie.ops import NativeOps, select_ops
from yaie.ops import quant_layout as quant
from yaie.ops.quant_layout import pack_weight

T = GGMLQuantizationType
# name, K, N, type: SmolLM2-135M's linears with QKV and gate/up fused, as the GGUF stores them.
SHAPES = [
    ("qkv", 576, 960, T.Q4_1),
    ("gate_up", 576, 3072, T.Q4_1),
    ("down", 1536, 576, T.Q4_1),
    ("o_proj", 576, 576, T.Q4_1),
    ("lm_head", 576, 49152, T.Q8_0),
]
# Llama-3.2-1B's (hidden 2048, GQA 32/8 heads of 64, MLP 8192), typed as a Q4_0 file stores them.
LLAMA_1B_SHAPES = [
    ("qkv", 2048, 3072, T.Q4_0),
    ("gate_up", 2048, 16384, T.Q4_0),
    ("down", 8192, 2048, T.Q4_0),
    ("o_proj", 2048, 2048, T.Q4_0),
]


def unpack_types() -> list[GGMLQuantizationType]:
    """The types quant_layout packs (the K-quants have their own kernels and benchmark)."""
    return [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.IQ4_NL]


def random_blocks(ggml_type: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    """Random GGUF blocks with small finite float16 scales (the timing does not depend on values)."""
    gen = np.random.default_rng(0)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    raw = gen.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
    for offset in (0, 2) if ggml_type in (T.Q4_1, T.Q5_1) else (0,):
        scale = (gen.standard_normal((n, k // block_size, 1)) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = scale.view(np.uint8)
    return raw.reshape(n, -1)


def median_ms(fn: Callable[[], torch.Tensor], min_time: float) -> float:
    fn()  # warm-up: first-touch of buffers, oneDNN primitive creation
    times: list[float] = []
    while sum(times) < min_time or len(times) < 3:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of calls per measurement")
    parser.add_argument("--shapes", choices=("smollm2", "llama-1b"), default="smollm2")
    parser.add_argument("--types", nargs="+", choices=[t.name for t in unpack_types()],
                        help="run every weight in each of these types instead of its own")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/quant_matmul.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    console = make_console()
    ops = select_ops(torch.device("cpu"))
    if not isinstance(ops, NativeOps):
        console.print("the native kernels did not build: nothing to measure")
        return 1
    isa = ops.quant_isa

    table = Table(title=f"quantized matmul vs oneDNN fp32, {args.threads} threads, ISA {isa} (ms per call)")
    for column in ("weight", "type", "M", "int8", "fp32", "fp32/int8", "bg cores"):
        table.add_column(column, justify="left" if column in ("weight", "type") else "right")
    rows = []
    shapes = SHAPES if args.shapes == "smollm2" else LLAMA_1B_SHAPES
    if args.types:
        shapes = [(name, k, n, T[t]) for t in args.types for name, k, n, _ in shapes]
    for name, k, n, ggml_type in shapes:
        packed = pack_weight(unpack_gguf(random_blocks(ggml_type, n, k), ggml_type, n, k))
        layer = QuantizedLinear(*packed, n, ops=ops)
        dense = DenseLinear(k, n)
        dense.weight.data = layer.dequantize().contiguous()
        dense.pack()
        weight = (layer.qweight, layer.scales, layer.mins, None, n)
        for m in args.rows:
            x = torch.randn(m, k)
            before = cpu_sample()
            with torch.inference_mode():
                int8 = median_ms(
                    lambda x=x, w=weight: torch.ops.yaie.quant_matmul(x, *w, quant.ISAS.index(isa)),
                    args.min_time,
                )
                fp32 = median_ms(lambda x=x, dense=dense: dense(x), args.min_time)
            busy = background_cores(before, cpu_sample())
            rows.append(dict(weight=name, type=ggml_type.name, k=k, n=n, m=m, int8_ms=int8, fp32_ms=fp32,
                             background_cores=busy))
            table.add_row(name, ggml_type.name, str(m), f"{int8:.3f}", f"{fp32:.3f}", f"{fp32 / int8:.2f}",
                          f"{busy:.2f}")
    console.print(table)
    report = {"machine": machine_info(), "isa": isa, "threads": args.threads, "shapes": args.shapes,
              "rows": rows}
    write_report(args.out, report, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
