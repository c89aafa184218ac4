from __future__ import annotations

import os

import pytest
import torch

from yaie.ops import NativeOps, Ops, TorchOps, kernels, select_ops

CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def native_kernels() -> None:
    """The native CPU kernels, built. Where the user turned them off, the test is skipped; where
    they fail to build, it fails: CI machines have a compiler, so that is a bug."""
    if os.environ.get("YAIE_NATIVE_KERNELS") == "0":
        pytest.skip("YAIE_NATIVE_KERNELS=0")
    assert kernels.load(), "the native kernels did not build (see the warning above)"


@pytest.fixture
def native_ops(native_kernels: None) -> Ops:
    """The op backend a model loaded now runs on: the native one."""
    ops = select_ops(CPU)
    assert isinstance(ops, NativeOps)
    return ops


@pytest.fixture
def pytorch_only(monkeypatch: pytest.MonkeyPatch) -> Ops:
    """Run the model as machines without the native kernels do: on the torch op backend, which
    models loaded (and backends selected) during the test get. Returns that backend."""
    monkeypatch.setattr(kernels, "available", lambda device: False)
    ops = select_ops(CPU)
    assert type(ops) is TorchOps
    return ops
