from __future__ import annotations

import os

import pytest
import torch

from yaie.model import kernels


@pytest.fixture(scope="session")
def native_kernels() -> None:
    """The native CPU kernels, built. Where the user turned them off, the test is skipped; where
    they fail to build, it fails: CI machines have a compiler, so that is a bug."""
    if os.environ.get("YAIE_NATIVE_KERNELS") == "0":
        pytest.skip("YAIE_NATIVE_KERNELS=0")
    assert kernels.load(), "the native kernels did not build (see the warning above)"


@pytest.fixture
def pytorch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the model as machines without the native kernels do: on PyTorch ops alone."""
    monkeypatch.setattr(kernels, "available", lambda device: False)
    assert not kernels.available(torch.device("cpu"))
