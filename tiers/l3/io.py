"""Slot data paths: POSIX preadv/pwritev (O_DIRECT or buffered) on a thread pool, and kvikio (GPUDirect).

Every backend writes the same page bytes at the same slot offsets and returns the xxh3_64 of exactly the
bytes it wrote or read, so the store can verify reads without knowing which path ran.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from tiers.l3 import native
from tiers.l3.format import ALIGN, checksum, checksum_stream
from tiers.l3.slab import SlabFile

IOV_MAX = 1024
# A page whose buffer is the O_DIRECT buffer itself moves in pieces of this size, each hashed right after it is read
# (right before it is written) while it is in the CPU's cache: one pass over memory instead of two. Large enough
# that a disk still sees big requests (several threads keep it busy), small enough to stay in a core's L2.
FUSED_PIECE_BYTES = 1 << 20
# A slab in memory (tmpfs) is copied to and from a mapping of it. Where the one-pass copy is on (x86-64 with AVX2,
# tiers/l3/copy_hash.h) a page is copied and hashed in one pass; elsewhere it is hashed in pieces of this size, a
# quarter of a 1 MiB L2, so the piece just copied is still there when it is hashed. Either way mapped, hashed reads
# beat pread of whole pages with no hash, and writes through the mapping beat pwrite (tmpfs serialises pwrite on the
# file's lock; bench/RESULTS.md, 'L3 store vs raw O_DIRECT').
MAPPED_PIECE_BYTES = 256 << 10
# The least a helper thread takes of a mapped call: handing work to an I/O thread and waiting for it back costs
# about what copying and hashing 1 MiB does (50-100 us), so a smaller share is faster done by the caller itself.
MAPPED_HELPER_BYTES = 4 << 20


@dataclass
class SlotResult:
    """Outcome of one page's I/O: `digest` of the bytes moved, or `error` (an OSError; "short" reads too)."""

    digest: int | None = None
    error: OSError | None = None


def _host_view(tensor: torch.Tensor) -> memoryview:
    array: Any = tensor.numpy()  # a numpy array is a buffer; numpy's stubs do not say so
    return memoryview(array).cast("B")


def _is_aligned(tensor: torch.Tensor, slot_bytes: int) -> bool:
    """True if the tensor can be the O_DIRECT buffer itself (CPU, 4 KiB aligned, fills the slot)."""
    return (tensor.device.type == "cpu" and tensor.data_ptr() % ALIGN == 0
            and tensor.numel() == slot_bytes)


class _Bounce(threading.local):
    """A per-thread, page-aligned (mmap) staging buffer, grown on demand."""

    def get(self, size: int) -> tuple[memoryview, torch.Tensor]:
        if getattr(self, "size", 0) < size:
            self.buffer = mmap.mmap(-1, size)
            self.view = memoryview(self.buffer)
            self.tensor = torch.frombuffer(self.buffer, dtype=torch.uint8)
            self.size = size
        return self.view, self.tensor


class PosixSlotIO:
    """preadv/pwritev at slot offsets; adjacent slots coalesce into one vectored call per chunk.

    A slab that lives in memory (tmpfs, ramfs, hugetlbfs) is read and written through a shared mapping of it instead
    (`map_reads`; None: where the native loop is there and the file is in memory): a call's pages are one native
    batch of copies, each page hashed as it is copied, with no system call per piece (`_copy_mapped`). The name is
    then "mapped". Writes go through the mapping only where every byte of the slab is allocated: a write fault on a
    hole of a full tmpfs raises SIGBUS, where pwrite would return ENOSPC. On tmpfs the mapping's pages are the
    file's, so fsync has nothing more to do. A thread faults the mapping in from the start (`MappedFile.populate`);
    slots past its mark keep pread/pwrite until then."""

    def __init__(self, slab: SlabFile, page_bytes: int, io_threads: int, max_io_bytes: int,
                 map_reads: bool | None = None) -> None:
        self.slab = slab
        self.name = "posix" if slab.direct else "buffered"
        self.page_bytes = page_bytes
        self.slot_bytes = slab.header.slot_bytes
        self.io_threads = max(1, io_threads)
        self.max_slots_per_io = max(1, min(IOV_MAX, max_io_bytes // self.slot_bytes))
        self.pool = ThreadPoolExecutor(self.io_threads, thread_name_prefix="l3-io")
        self.bounce = _Bounce()
        self.native = native.load()  # a page in one C call, the lock released (tiers/l3/native.py); None: Python
        self.mapped: native.MappedFile | None = None
        # calls copying through the mapping right now: close waits for them before it unmaps (a copy into memory
        # unmapped under it would crash the process, not raise)
        self._mapped_calls = 0
        # threads copying through the mapping right now, callers and helpers: a call takes helpers only while this
        # stays within io_threads (`_copy_mapped`)
        self._copying = 0
        self._mapped_closing = False
        self._mapped_idle = threading.Condition()
        if map_reads is None:
            map_reads = self.native is not None and self.native.in_memory(slab.meta_fd)
        if map_reads:
            if self.native is None:
                raise OSError(errno.ENOTSUP, f"{slab.path}: mapped reads need the native page loop "
                                             "(built at install, with libxxhash; see tiers/l3/native.py)")
            size = slab.header.file_bytes()
            st = os.fstat(slab.meta_fd)
            writable = not slab.read_only and st.st_size >= size and st.st_blocks * 512 >= size
            self.mapped = self.native.map(slab.meta_fd, size, writable)
            self.name = "mapped"
            # faulted in from the start by a thread of its own; pages past its mark keep pread/pwrite meanwhile
            self._populating = threading.Thread(target=self.mapped.populate, name="l3-map-populate", daemon=True)
            self._populating.start()

    def _chunks(self, slots: Sequence[int]) -> list[list[int]]:
        """Item indices grouped into runs of consecutive slots, each at most one I/O long."""
        order = sorted(range(len(slots)), key=lambda i: slots[i])
        per_io = max(1, min(self.max_slots_per_io, -(-len(order) // self.io_threads)))
        chunks: list[list[int]] = []
        for i in order:
            last = chunks[-1] if chunks else None
            if last and len(last) < per_io and slots[i] == slots[last[-1]] + 1:
                last.append(i)
            else:
                chunks.append([i])
        return chunks

    def _run(self, job: Callable[..., None], slots: Sequence[int], tensors: Sequence[torch.Tensor]) -> list[SlotResult]:
        results = [SlotResult() for _ in slots]
        chunks = self._chunks(slots)
        if len(chunks) == 1:
            job(chunks[0], slots, tensors, results)
        else:
            for f in [self.pool.submit(job, c, slots, tensors, results) for c in chunks]:
                f.result()
        return results

    def _run_mapped(self, write: bool, slots: Sequence[int],
                    tensors: Sequence[torch.Tensor]) -> list[SlotResult] | None:
        """The whole call through the mapping (`_copy_mapped` over every page, all I/O threads on it), or None where a
        page cannot go that way (see `_mappable`)."""
        everything = range(len(slots))
        if not slots or not self._mappable(everything, slots, tensors, write):
            return None
        results = [SlotResult() for _ in slots]
        self._copy_mapped(write, everything, slots, tensors, results, min(self.io_threads, len(slots)))
        return results

    def _copy_mapped(self, write: bool, items: Sequence[int], slots: Sequence[int], tensors: Sequence[torch.Tensor],
                     results: list[SlotResult],
                     workers: int = 1) -> None:
        """Copy and hash pages `items` to or from the mapping as one `MappedBatch`: the caller's thread and up to
        workers - 1 of the I/O threads each enter C once and take the next page until none is left. One Python entry
        a thread rather than a page, so the threads do not queue for the interpreter lock between pages, and a slow
        page holds up one thread only.

        The caller works rather than waits. It takes a helper for each further MAPPED_HELPER_BYTES of the call, and
        only while the threads copying through the mapping, callers included, stay within io_threads. When many
        callers copy at once (an engine's threads, each with a page or two), they already keep the cores busy: a
        helper's hand-off there costs more than its share of the copy, and the I/O threads would become the callers'
        queue (bench/RESULTS.md, 'Engine tiers against the engines' own')."""
        offset = self.slab.header.slot_offset
        assert self.mapped is not None  # callers copy through the mapping only when there is one
        batch = self.mapped.batch(write, [tensors[i].data_ptr() for i in items], [offset(slots[i]) for i in items],
                                  self.page_bytes, MAPPED_PIECE_BYTES)
        with self._mapped_idle:
            worth = len(items) * self.page_bytes // MAPPED_HELPER_BYTES - 1
            helping = max(0, min(workers - 1, worth, self.io_threads - self._copying - 1))
            self._copying += 1 + helping
        try:
            helpers = [self.pool.submit(batch.run) for _ in range(helping)]
            batch.run()
            for f in helpers:
                f.result()
        finally:
            with self._mapped_idle:
                self._copying -= 1 + helping
        for i, (digest, error) in zip(items, batch.outcomes()):
            results[i] = SlotResult(digest=digest, error=error)

    def settle(self, timeout: float | None = None) -> bool:
        """Block until the mapping is faulted in, so that every slot moves through it; True once it is (or where
        there is no mapping), False on timeout."""
        if self.mapped is None:
            return True
        self._populating.join(timeout)
        return not self._populating.is_alive()

    def write(self, slots: Sequence[int], pages: Sequence[torch.Tensor]) -> list[SlotResult]:
        """Write each page to its slot (zero-padded to slot_bytes). Not synced: call slab.sync()."""
        if self.mapped is None:
            return self._run(self._write_chunk, slots, pages)
        with self._using_mapping():
            done = self._run_mapped(True, slots, pages)
            return done if done is not None else self._run(self._write_chunk, slots, pages)

    def read(self, slots: Sequence[int], out: Sequence[torch.Tensor]) -> list[SlotResult]:
        """Read each slot into its tensor; a slot cut short by EOF reports an ENODATA error."""
        if self.mapped is None:
            return self._run(self._read_chunk, slots, out)
        with self._using_mapping():
            done = self._run_mapped(False, slots, out)
            return done if done is not None else self._run(self._read_chunk, slots, out)

    @contextlib.contextmanager
    def _using_mapping(self) -> Iterator[None]:
        """Count a call that may copy through the mapping (in its own thread or the pool's); refused once close
        has begun, which waits for the count to reach zero before it unmaps."""
        with self._mapped_idle:
            if self._mapped_closing:
                raise OSError(errno.EBADF, f"{self.slab.path}: L3 slab I/O is closed")
            self._mapped_calls += 1
        try:
            yield
        finally:
            with self._mapped_idle:
                self._mapped_calls -= 1
                self._mapped_idle.notify_all()

    def _fused(self, chunk: list[int], buffers: Sequence[torch.Tensor]) -> bool:
        """Whether every page of the chunk moves in hashed pieces (its buffer is the whole slot, aligned)."""
        return self.page_bytes == self.slot_bytes and all(_is_aligned(buffers[i], self.slot_bytes) for i in chunk)

    def _native_pages(self, move: Callable[..., int], chunk: list[int], slots: Sequence[int],
                      buffers: Sequence[torch.Tensor], results: list[SlotResult]) -> None:
        """Each page of the chunk in one call of the native loop (`move`: its read or write)."""
        fd, header = self.slab.data_fd, self.slab.header
        for i in chunk:
            try:
                results[i].digest = move(fd, buffers[i].data_ptr(), self.page_bytes, header.slot_offset(slots[i]),
                                         FUSED_PIECE_BYTES)
            except OSError as e:
                results[i] = SlotResult(error=e)

    def _write_fused(self, chunk: list[int], slots: Sequence[int], pages: Sequence[torch.Tensor],
                     results: list[SlotResult]) -> None:
        fd = self.slab.data_fd
        if self.native is not None:
            self._native_pages(self.native.write, chunk, slots, pages, results)
            return
        for i in chunk:
            view, offset, h = _host_view(pages[i]), self.slab.header.slot_offset(slots[i]), checksum_stream()
            try:
                for start in range(0, len(view), FUSED_PIECE_BYTES):
                    piece = view[start:start + FUSED_PIECE_BYTES]
                    h.update(piece)
                    _pwritev_all(fd, [piece], offset + start)
            except OSError as e:
                results[i] = SlotResult(error=e)
                continue
            results[i].digest = h.digest()

    def _read_fused(self, chunk: list[int], slots: Sequence[int], out: Sequence[torch.Tensor],
                    results: list[SlotResult]) -> None:
        fd = self.slab.data_fd
        if self.native is not None:
            self._native_pages(self.native.read, chunk, slots, out, results)
            return
        for i in chunk:
            view, offset, h = _host_view(out[i]), self.slab.header.slot_offset(slots[i]), checksum_stream()
            try:
                for start in range(0, len(view), FUSED_PIECE_BYTES):
                    piece = view[start:start + FUSED_PIECE_BYTES]
                    if _preadv_all(fd, [piece], offset + start) < len(piece):
                        raise OSError(errno.ENODATA, "short read (slab truncated?)")
                    h.update(piece)
            except OSError as e:
                results[i] = SlotResult(error=e)
                continue
            results[i].digest = h.digest()

    def _write_chunk(self, chunk: list[int], slots: Sequence[int], pages: Sequence[torch.Tensor],
                     results: list[SlotResult]) -> None:
        if self._mappable(chunk, slots, pages, write=True):
            self._copy_mapped(True, chunk, slots, pages, results)
            return
        if self._fused(chunk, pages):
            self._write_fused(chunk, slots, pages, results)
            return
        bounce, bounce_tensor = self.bounce.get(len(chunk) * self.slot_bytes)
        iov: list[memoryview] = []
        for k, i in enumerate(chunk):
            page = pages[i]
            if _is_aligned(page, self.slot_bytes):
                view = _host_view(page)
            else:  # stage through the aligned buffer; padding past the page is zero
                start = k * self.slot_bytes
                bounce_tensor[start:start + self.page_bytes].copy_(page)
                bounce_tensor[start + self.page_bytes:start + self.slot_bytes].zero_()
                view = bounce[start:start + self.slot_bytes]
            results[i].digest = checksum(view[:self.page_bytes])
            iov.append(view)
        try:
            _pwritev_all(self.slab.data_fd, iov, self.slab.header.slot_offset(slots[chunk[0]]))
        except OSError as e:
            for i in chunk:
                results[i] = SlotResult(error=e)

    def _mappable(self, chunk: Sequence[int], slots: Sequence[int], out: Sequence[torch.Tensor],
                  write: bool = False) -> bool:
        """Whether every page of the chunk can be copied to or from the mapping: CPU memory, contiguous, page-sized,
        in the part of the mapping already faulted in, and for a write, a writable mapping."""
        if self.mapped is None or (write and not self.mapped.writable):
            return False
        mark, offset = self.mapped.populated - self.page_bytes, self.slab.header.slot_offset
        return all(offset(slots[i]) <= mark and out[i].device.type == "cpu" and out[i].is_contiguous()
                   and out[i].numel() * out[i].element_size() == self.page_bytes for i in chunk)

    def _read_chunk(self, chunk: list[int], slots: Sequence[int], out: Sequence[torch.Tensor],
                    results: list[SlotResult]) -> None:
        if self._mappable(chunk, slots, out):
            self._copy_mapped(False, chunk, slots, out, results)
            return
        if self._fused(chunk, out):
            self._read_fused(chunk, slots, out, results)
            return
        bounce, bounce_tensor = self.bounce.get(len(chunk) * self.slot_bytes)
        direct = [_is_aligned(out[i], self.slot_bytes) for i in chunk]
        iov = [_host_view(out[i]) if direct[k] else bounce[k * self.slot_bytes:(k + 1) * self.slot_bytes]
               for k, i in enumerate(chunk)]
        try:
            got = _preadv_all(self.slab.data_fd, iov, self.slab.header.slot_offset(slots[chunk[0]]))
        except OSError as e:
            for i in chunk:
                results[i] = SlotResult(error=e)
            return
        for k, i in enumerate(chunk):
            if got < (k + 1) * self.slot_bytes:  # slot [k*slot_bytes, (k+1)*slot_bytes) not fully read
                results[i] = SlotResult(error=OSError(errno.ENODATA, "short read (slab truncated?)"))
                continue
            if not direct[k]:
                out[i].copy_(bounce_tensor[k * self.slot_bytes:k * self.slot_bytes + self.page_bytes])
            results[i].digest = checksum(iov[k][:self.page_bytes])

    def close(self) -> None:
        if self.mapped is not None:  # calls copying through the mapping end first, in whichever thread they run
            with self._mapped_idle:
                self._mapped_closing = True
                self._mapped_idle.wait_for(lambda: self._mapped_calls == 0)
        self.pool.shutdown(wait=True)  # no read runs past this: the mapping can go
        if self.mapped is not None:
            self.mapped.stopped = True
            self._populating.join()
            self.mapped.close()


def _pwritev_all(fd: int, iov: list[memoryview], offset: int) -> None:
    """pwritev until every byte is written; raises OSError(EIO) if the device stops taking bytes."""
    total = sum(len(v) for v in iov)
    done = os.pwritev(fd, iov, offset)
    while done < total:
        rest = _skip(iov, done)
        n = os.pwritev(fd, rest, offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"short write: {done} of {total} bytes")
        done += n


def _preadv_all(fd: int, iov: list[memoryview], offset: int) -> int:
    """preadv until the buffers are full or EOF; returns the bytes read."""
    total = sum(len(v) for v in iov)
    done = os.preadv(fd, iov, offset)
    while 0 < done < total:
        n = os.preadv(fd, _skip(iov, done), offset + done)
        if n <= 0:
            break
        done += n
    return done


def _skip(iov: list[memoryview], count: int) -> list[memoryview]:
    """The iovec list with its first `count` bytes removed."""
    rest = []
    for v in iov:
        if count >= len(v):
            count -= len(v)
            continue
        rest.append(v[count:])
        count = 0
    return rest


class KvikioSlotIO:
    """kvikio.CuFile pread/pwrite straight between slot offsets and CUDA (or host) buffers."""

    name = "kvikio"

    def __init__(self, slab: SlabFile, page_bytes: int, io_threads: int = 8) -> None:
        import kvikio  # optional extra: hicache[gds]

        self.slab = slab
        self.page_bytes = page_bytes
        set_kvikio_threads(kvikio, io_threads)
        self.file = kvikio.CuFile(slab.path, "r" if slab.read_only else "r+")

    @staticmethod
    def _buffer(tensor: torch.Tensor) -> Any:
        return tensor if tensor.is_cuda else tensor.numpy()

    @staticmethod
    def _digest(tensor: torch.Tensor) -> int:
        host = tensor.cpu() if tensor.is_cuda else tensor
        return checksum(host.numpy())

    def _run(self, method: Callable[..., Any], slots: Sequence[int], tensors: Sequence[torch.Tensor],
             digest_first: bool) -> list[SlotResult]:
        results = [SlotResult() for _ in slots]
        futures = [method(self._buffer(t), self.page_bytes, self.slab.header.slot_offset(s))
                   for s, t in zip(slots, tensors)]
        if digest_first:  # writes: checksum the source while kvikio's threads write it (both only read it)
            for r, t in zip(results, tensors):
                r.digest = self._digest(t)
        for i, future in enumerate(futures):
            try:
                n = future.get()
                if n != self.page_bytes:
                    raise OSError(errno.ENODATA, f"short transfer: {n} of {self.page_bytes} bytes")
                if not digest_first:
                    results[i].digest = self._digest(tensors[i])
            except OSError as e:
                results[i] = SlotResult(error=e)
            except RuntimeError as e:
                results[i] = SlotResult(error=OSError(errno.EIO, str(e)))
        return results

    def write(self, slots: Sequence[int], pages: Sequence[torch.Tensor]) -> list[SlotResult]:
        return self._run(self.file.pwrite, slots, pages, digest_first=True)

    def read(self, slots: Sequence[int], out: Sequence[torch.Tensor]) -> list[SlotResult]:
        return self._run(self.file.pread, slots, out, digest_first=False)

    def close(self) -> None:
        self.file.close()


def set_kvikio_threads(kvikio_module: Any, threads: int) -> None:
    """Raise kvikio's I/O thread pool to `threads` (its default of 1 leaves the disk idle)."""
    try:
        import kvikio.defaults  # a submodule: not loaded by `import kvikio`
    except ImportError:
        return
    try:
        current = kvikio.defaults.num_threads()
        if current < threads:
            kvikio.defaults.set("num_threads", threads)
    except (AttributeError, TypeError):  # older kvikio: the setter has another name
        setter = getattr(kvikio.defaults, "num_threads_reset", None)
        if setter is not None:
            setter(threads)


def kvikio_usable() -> tuple[bool, str]:
    """Whether the kvikio path can run here, and why not."""
    if not torch.cuda.is_available():
        return False, "CUDA is not available"
    try:
        import kvikio  # noqa: F401
    except Exception as e:  # ImportError, or OSError when libcuda/libcufile is missing
        return False, f"kvikio import failed: {e}"
    return True, ""


def kvikio_compat_mode() -> bool:
    """Whether kvikio would run in its compatibility mode (POSIX I/O through its own bounce buffers, no
    GPUDirect Storage driver). True where that cannot be told. There it brings nothing over the POSIX path for
    host pages and was much slower on tmpfs than the POSIX path (bench/RESULTS.md, 'L3 store vs raw O_DIRECT')."""
    try:
        import kvikio.defaults
    except Exception:  # noqa: BLE001 - no kvikio, or its libraries fail to load
        return True
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(kvikio.defaults, name, None)
        if fn is None:
            continue
        try:
            mode = fn()
        except Exception:  # noqa: BLE001 - an API of another version
            continue
        return bool(mode) if isinstance(mode, bool) else "OFF" not in str(mode).upper()
    return True
