"""The ops a model runs (norms, rope, the KV cache write, paged decode attention, the gated
activation, argmax, quantized matmuls), in one backend chosen when the model is loaded.

  backend.py      what every backend does (Ops), op by op, with the semantics all keep
  torch_ops.py    PyTorch's ops: any device, and the reference
  native_ops.py   yaie's CPU kernels, where they are faster
  kernels.py      building and loading those kernels (csrc/)
  quant_layout.py the packed layout of quantized weights the kernels read

The model's modules hold the backend they were built with and never ask which it is; the native
decode path over every layer (yaie/model/fused_decode.py) is the runner's choice, made once.
"""

from __future__ import annotations

import logging
import os

import torch

from yaie.ops import kernels
from yaie.ops.backend import Ops
from yaie.ops.native_ops import NativeOps, choose_isa
from yaie.ops.torch_ops import TorchOps

__all__ = ["NativeOps", "Ops", "TorchOps", "select_ops"]

logger = logging.getLogger(__name__)


def select_ops(device: torch.device) -> Ops:
    """The backend for a model on `device`: the native kernels where they build for this CPU
    (YAIE_NATIVE_KERNELS=0 turns them off; a failed build warns once, in kernels.load), in the
    best ISA path it has or the one YAIE_QUANT_ISA names; else PyTorch's ops. Logged."""
    ops: Ops = (
        NativeOps(choose_isa(os.environ.get("YAIE_QUANT_ISA"))) if kernels.available(device) else TorchOps()
    )
    logger.info("op backend: %s", ops.name)
    return ops
