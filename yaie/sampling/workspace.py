"""Work buffers that the sampler keeps from step to step."""

from __future__ import annotations

import torch


class Workspace:
    """[rows, V] buffers kept from step to step, by name. On a CPU a fresh multi-megabyte
    tensor per operation is paid for in page faults, which cost as much as the arithmetic here."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A buffer shaped like ``like`` [rows, V] (uninitialised), grown as needed."""
        rows, cols = like.shape
        buffer = self._buffers.get(name)
        if (
            buffer is None
            or buffer.shape[0] < rows
            or buffer.shape[1] != cols
            or buffer.dtype != dtype
            or buffer.device != like.device
        ):
            buffer = torch.empty(rows, cols, dtype=dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:rows]
