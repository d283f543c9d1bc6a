"""Pinned host memory for the host pool, allocated fast.

`torch.empty(..., pin_memory=True)` lets the CUDA driver fault in and pin the buffer 4 KiB page by page on one
thread, which took tens of seconds for a large host tier at every start (bench/RESULTS.md, 'Host pool
pinning'). Here the buffer is an anonymous mapping advised to use transparent huge pages (2 MiB: 512x fewer faults
where the kernel allows them), its pages are faulted in by several threads at once (torch zeroes each slice with the
GIL released), and the resident memory is then registered with the driver in one `cudaHostRegister` call. Copies from
it run at pinned speed, and `Tensor.is_pinned()` is true, as for torch's own pinned memory.

Where registration is refused (no CUDA, a driver or container limit), `pinned_empty` falls back to torch's pinned
allocation and logs why.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)

_MAX_TOUCH_THREADS = 16


def touch_in_parallel(buf: torch.Tensor, threads: int) -> None:
    """Fault in every page of the 1-D uint8 tensor `buf` by zeroing equal slices of it from `threads` threads."""
    step = -(-buf.numel() // max(1, threads))
    slices = [buf[start : start + step] for start in range(0, buf.numel(), step)]
    workers = [threading.Thread(target=torch.Tensor.zero_, args=(part,), name="hicache-pin") for part in slices[1:]]
    for w in workers:
        w.start()
    if slices:
        slices[0].zero_()
    for w in workers:
        w.join()


def anonymous_buffer(nbytes: int, huge_pages: bool = True) -> torch.Tensor:
    """A 1-D uint8 tensor over a fresh anonymous private mapping, advised to use transparent huge pages where the
    platform has the advice. The tensor's storage keeps the mapping alive, and the mapping is unmapped when the last
    tensor viewing it goes: never `close()` it (torch holds no buffer export, so close would unmap under them)."""
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError as e:  # THP disabled or unsupported: 4 KiB pages, only slower to fault in
            logger.debug("MADV_HUGEPAGE refused: %s", e)
    return torch.frombuffer(mapping, dtype=torch.uint8)


def shared_buffer(nbytes: int, name: str = "hicache-host-pool") -> tuple[torch.Tensor, int]:
    """A 1-D uint8 tensor over a fresh memfd mapped MAP_SHARED, and the memfd: another process (the L3 process,
    tiers/l3/process.py) maps the same memory through that descriptor, so it reads and writes the pages in
    place. The tensor's storage keeps the mapping alive (never `close()` it: see `anonymous_buffer`); the caller
    owns the descriptor. memfd memory is shmem: transparent huge pages only where shmem_enabled allows them."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return torch.frombuffer(mapping, dtype=torch.uint8), fd


def _torch_pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def _register(ptr: int, nbytes: int) -> str | None:
    """cudaHostRegister the range; None on success, else why not."""
    try:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)
    except (AssertionError, RuntimeError) as e:  # a torch built without CUDA
        return str(e)
    return None if int(err) == 0 else str(err)


def _unregister(ptr: int) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(ptr)
    if int(err) != 0:
        logger.warning("cudaHostUnregister of the host pool's memory failed: %s", err)


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype, threads: int | None = None,
                 shared: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised (in fact zeroed) page-locked CPU tensor of `shape`, pinned as the module doc says.

    `shared`: pin this 1-D uint8 buffer (from `shared_buffer`) instead of a fresh private mapping; there a refused
    registration raises, since torch's own pinned memory could not be shared.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0 and shared is None:
        return _torch_pinned(shape, dtype)
    threads = threads or min(_MAX_TOUCH_THREADS, os.cpu_count() or 1)
    start = time.perf_counter()
    flat = anonymous_buffer(nbytes) if shared is None else shared[:nbytes]
    touch_in_parallel(flat, threads)
    touched = time.perf_counter()
    err = _register(flat.data_ptr(), nbytes)
    if err is not None:
        if shared is not None:
            raise RuntimeError(f"cudaHostRegister of the shared host pool ({nbytes / 2**30:.1f} GiB) refused: {err}")
        del flat
        logger.warning("cudaHostRegister of %.1f GiB refused (%s): pinning with torch instead, page by page",
                       nbytes / 2**30, err)
        return _torch_pinned(shape, dtype)
    tensor = flat.view(dtype).view(shape)
    # unregistered when this tensor object goes (its owner, the host pool, went); views left over still read the
    # memory, unpinned, until the last one goes and takes the mapping with it
    weakref.finalize(tensor, _unregister, flat.data_ptr())
    done = time.perf_counter()
    logger.info("pinned %.1f GiB in %.1f s (%d threads faulted it in in %.1f s, registration %.1f s)",
                nbytes / 2**30, done - start, threads, touched - start, done - touched)
    return tensor


def map_host_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor aliasing pinned host `tensor` through unified addressing, or None if unavailable."""
    try:
        import cupy
    except ImportError:
        return None
    try:
        nbytes = tensor.numel() * tensor.element_size()
        with cupy.cuda.Device(device.index or 0):
            mem = cupy.cuda.UnownedMemory(tensor.data_ptr(), nbytes, tensor, device_id=device.index or 0)
            array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
            alias = torch.as_tensor(array, device=device)
        return alias.view(tensor.dtype).view(tensor.shape)
    except Exception:  # noqa: BLE001 - any failure means: no mapping, use the DMA path
        return None
