"""Small per-step transfers (step inputs in, sampled tokens out) that never queue behind tier transfers.

CUDA copy engines serve their copies in submission order, whatever the stream. Measured on an H200
(bench/gpu/copy_engine_probe.py): with a 2 GiB host -> GPU load queued on a side stream, a 32 KiB pinned
copy on the compute stream completes only after it (39 ms), and a pageable GPU -> host read of a few bytes
(`tensor.tolist()`) waits as long for a 2 GiB backup the other way. So the engine's own small copies would
wait for the page loads and backups the controller overlaps with compute.

`HostStaging` moves them with GPU kernels instead: a pinned int64 buffer mapped into the GPU's address
space (unified addressing, the same mapping tiers.map_host_tensor gives the copier for small pages) that a kernel reads
(inputs) or writes (sampled tokens). Without the mapping (no CUDA, or no CuPy to wrap the pointer) it
falls back to ordinary copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from tiers import map_host_tensor


def kernel_copy(dst: Tensor, src: Tensor) -> None:
    """dst[:] = src with an elementwise kernel (not a memcpy, which the driver may give to a copy engine)."""
    torch.bitwise_or(src, 0, out=dst)


class HostStaging:
    """A growable pinned int64 buffer for one engine's small transfers; see the module doc."""

    def __init__(self, device: torch.device, size: int = 1 << 16):
        self.device = device
        self.mapped = False
        self._read = torch.cuda.Event()  # the last kernel reading the buffer (an upload) was queued before this
        self._alloc(size)

    def _alloc(self, size: int) -> None:
        self.host = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self.array = self.host.numpy()
        self.alias = map_host_tensor(self.host, self.device)
        self.mapped = self.alias is not None

    def upload(self, values: Sequence[int] | np.ndarray) -> Tensor:
        """A new int64 device tensor holding values (queued on the current stream; the host does not wait
        for it, only, before overwriting the buffer, for the previous upload's kernel to have read it)."""
        n = len(values)
        self._read.synchronize()  # usually long done: a step ends by reading its sampled tokens
        if n > self.host.numel():
            self._alloc(max(n, 2 * self.host.numel()))
        self.array[:n] = values
        out = torch.empty(n, dtype=torch.int64, device=self.device)
        if self.mapped:
            kernel_copy(out, self.alias[:n])
            self._read.record()
        else:
            out.copy_(self.host[:n], non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()  # the buffer is reused at once
        return out

    def download(self, values: Tensor) -> list[int]:
        """values (int64, on the device) as a list, after the current stream's work up to now."""
        n = values.numel()
        if not self.mapped:
            return values.tolist()
        if n > self.host.numel():
            self._read.synchronize()
            self._alloc(max(n, 2 * self.host.numel()))
        kernel_copy(self.alias[:n], values.reshape(-1))
        torch.cuda.current_stream(self.device).synchronize()
        return self.array[:n].tolist()
