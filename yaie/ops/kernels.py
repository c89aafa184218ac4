"""The native CPU kernels (csrc/): building and loading them, and each op as a typed function.

PyTorch's own ops cover everything yaie does; these kernels only do some of it faster. So a
machine that cannot build them (no compiler, or YAIE_NATIVE_KERNELS=0) runs the torch op backend
(yaie/ops/torch_ops.py), with one warning saying why. The build takes a while once; torch caches
it under ~/.cache/torch_extensions and rebuilds when the source changes. The build is for this CPU
(-march=native), so it is cached under a name keyed by the CPU's instruction-set flags: a home
folder shared by machines with different CPUs then holds one build per CPU, never one that
another CPU cannot run.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "paged_attention.cpp",
        "rms_norm.cpp",
        "rope_cache.cpp",
        "quant_matmul.cpp",
        "quant_x86.cpp",
        "quant_avx512.cpp",
        "kquant.cpp",
        "kquant_x86.cpp",
        "activation.cpp",
        "decode_layer.cpp",
        "argmax.cpp",
    )
]
# -march=native: the build is per machine anyway. -ffast-math: see paged_attention.cpp.
# -fopenmp: at::parallel_for is OpenMP inside torch's headers, and runs serially without it;
# the libgomp it links is the one torch already loaded (same soname), so no second pool.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]


def available(device: torch.device) -> bool:
    """Whether tensors on `device` can use the kernels (building them on first call). The model
    does not ask: its op backend was chosen once, at load (yaie/ops/backend.py: select_ops)."""
    return device.type == "cpu" and load()


def cpu_key(cpuinfo: str, machine: str) -> str:
    """A short hash of the CPU's architecture and instruction-set flags (from /proc/cpuinfo's
    `flags` line on x86, `Features` on Arm; without either, of the architecture alone)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            break  # every core lists the same flags
    return hashlib.sha256(" ".join([machine, *sorted(flags)]).encode()).hexdigest()[:16]


def extension_name() -> str:
    """The name torch caches this machine's build under."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: the architecture alone keys the build
        cpuinfo = ""
    return f"yaie_kernels_{cpu_key(cpuinfo, platform.machine())}"


@functools.cache
def load() -> bool:
    """Build (or find in the cache) and load the kernels into torch.ops.yaie; False if we can't."""
    if os.environ.get("YAIE_NATIVE_KERNELS", "1") == "0":
        return False
    from torch.utils import cpp_extension

    name = extension_name()
    logger.info("loading yaie's CPU kernels (%s); a CPU's first start compiles them (a minute or two)", name)
    try:
        # The directory load() builds `name` in (torch's helper: it depends on TORCH_EXTENSIONS_DIR
        # and the Python and CUDA versions).
        with _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
            cpp_extension.load(
                name=name,
                sources=[str(path) for path in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                is_python_module=False,
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError, subprocess.CalledProcessError) as exc:
        logger.warning("native CPU kernels unavailable, using the PyTorch path (slower): %s", exc)
        return False
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Holds `build_dir` for this process while it builds or loads. torch guards a build with a
    `lock` file, which a build killed midway (Ctrl-C during a first start) leaves behind, and every
    later start then waits on it forever, silently. An flock is released by the OS with its
    holder: while we hold it no other yaie process is building here, so a `lock` file found then
    is such a leftover, and goes."""
    with open(build_dir / "yaie.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its paged K/V: q [seqs, heads, dim] -> [seqs, heads, dim],
    in q's dtype. Caches are [blocks, block_size, kv_heads, dim], in q's dtype or another float
    dtype (the maths is fp32 either way); block_tables [seqs, max_blocks] and context_lens [seqs]
    are int64. Call only after `load()` returned True."""
    out: torch.Tensor = torch.ops.yaie.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale
    )
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place), then return rms_norm(residual) * weight; all [tokens, hidden]."""
    out: torch.Tensor = torch.ops.yaie.add_rms_norm(x, residual, weight, eps)
    return out


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [tokens, heads, head_dim] in place by RotaryEmbedding's tables; returns x."""
    out: torch.Tensor = torch.ops.yaie.apply_rope_(x, cos, sin)
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Copy each token's k and v heads [tokens, kv_heads, head_dim] into its cache slot, converted
    to the caches' dtype (rounding to nearest, as `Tensor.to` does)."""
    torch.ops.yaie.write_kv(k, v, slot_mapping, k_cache, v_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [tokens, 2 * intermediate] float32 -> [tokens, intermediate];
    about an ulp from PyTorch's silu (see csrc/activation.cpp for who may use it)."""
    out: torch.Tensor = torch.ops.yaie.silu_and_mul(gate_up)
    return out


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1) for contiguous float32 logits [rows, vocab] -> int64 [rows],
    the same indices (first of equal maxima, first NaN), without PyTorch's value-at-a-time loop."""
    out: torch.Tensor = torch.ops.yaie.argmax_rows(logits)
    return out


def quant_isa_supported(isa: int) -> bool:
    """Whether this CPU runs the quantized kernels' path ISAS[isa] (yaie/ops/quant_layout.py)."""
    return bool(torch.ops.yaie.quant_isa_supported(isa))


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    out_features: int,
    isa: int,
) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ the packed weight^T (+ bias) -> float32 [rows, out]: x
    quantized to int8 per 32 values, integer dot products in the ISA path ISAS[isa]."""
    out: torch.Tensor = torch.ops.yaie.quant_matmul(x, qweight, scales, mins, bias, out_features, isa)
    return out


def quant_embedding(
    qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, ids: torch.Tensor
) -> torch.Tensor:
    """The packed table's rows of `ids` [tokens], dequantized: float32 [tokens, dim]."""
    out: torch.Tensor = torch.ops.yaie.quant_embedding(qweight, scales, mins, ids)
    return out


def kquant_matmul(
    x: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor | None, out_features: int, isa: int
) -> torch.Tensor:
    """x [rows, in] float32 contiguous @ the K-quant parts' rows^T (+ bias) -> float32 [rows,
    out_features]: x quantized once per 256 values (csrc/kquant.h), in the ISA path ISAS[isa]."""
    out: torch.Tensor = torch.ops.yaie.kquant_matmul(x, parts, bias, out_features, isa)
    return out


def kquant_dequantize(packed: torch.Tensor, first_group: int, groups: int) -> torch.Tensor:
    """Record groups first_group .. first_group + groups of a K-quant weight as float32 [groups * 16, in]."""
    out: torch.Tensor = torch.ops.yaie.kquant_dequantize(packed, first_group, groups)
    return out


def kquant_embedding(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The K-quant table's rows of `ids` [tokens], dequantized: float32 [tokens, dim]."""
    out: torch.Tensor = torch.ops.yaie.kquant_embedding(table, ids)
    return out
