"""Fast pinned allocation for the host pool (tiers/pinned.py): the parts that run without CUDA, and on CUDA the
registered memory itself; a pool larger than the memory available is refused before any of it is touched."""

import gc

import pytest
import torch

from tiers import pinned


def test_touch_in_parallel_writes_every_slice():
    buf = torch.full((1000,), 7, dtype=torch.uint8)  # 7 threads over 1000 bytes: slices of 143, the last of 142
    pinned.touch_in_parallel(buf, 7)
    assert int(buf.count_nonzero()) == 0
    buf.fill_(5)
    pinned.touch_in_parallel(buf, 1)
    assert int(buf.count_nonzero()) == 0


def test_anonymous_buffer_outlives_its_mapping_object_while_viewed():
    buf = pinned.anonymous_buffer(1 << 21)
    view = buf[100:200]
    del buf
    gc.collect()
    view.fill_(9)  # the storage holds the mapping: still mapped, writable
    assert view.numel() == 100 and int(view.sum()) == 900


def test_pinned_empty_registers_once_and_unregisters_with_the_tensor(monkeypatch):
    calls = []
    monkeypatch.setattr(pinned, "_register", lambda ptr, n: calls.append(("register", ptr, n)))
    monkeypatch.setattr(pinned, "_unregister", lambda ptr: calls.append(("unregister", ptr)))
    t = pinned.pinned_empty((3, 5, 7), torch.bfloat16, threads=4)
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert int(t.count_nonzero()) == 0
    assert calls == [("register", t.data_ptr(), 3 * 5 * 7 * 2)]
    t[1, 2, 3] = 1.5
    assert t.view(-1)[1 * 35 + 2 * 7 + 3].item() == 1.5
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert calls[-1] == ("unregister", ptr)


def test_pinned_empty_falls_back_to_torch_when_registration_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(pinned, "_register", lambda ptr, n: "cudaErrorHostMemoryAlreadyRegistered")
    fallback = []
    monkeypatch.setattr(pinned, "_torch_pinned", lambda shape, dtype: fallback.append((shape, dtype)) or
                        torch.zeros(shape, dtype=dtype))
    t = pinned.pinned_empty((4, 4), torch.float32)
    assert fallback == [((4, 4), torch.float32)] and t.shape == (4, 4)
    assert "refused (cudaErrorHostMemoryAlreadyRegistered)" in caplog.text


@pytest.mark.cuda
def test_registered_memory_is_pinned_and_copies_both_ways():
    t = pinned.pinned_empty((64, 1024), torch.bfloat16)
    assert t.is_pinned() and t[3:9].is_pinned()
    src = torch.randn(64, 1024, device="cuda").bfloat16()
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    back = t.to("cuda", non_blocking=True)
    assert torch.equal(back, src)
    del t, back
    gc.collect()
    torch.cuda.synchronize()


def test_a_host_pool_larger_than_available_memory_is_refused_clearly(monkeypatch):
    from tiers import HostPool, KVLayout, host_pool

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, itemsize=4)  # 1 KiB pages
    monkeypatch.setattr(host_pool, "available_memory_bytes", lambda: 100 * 1024)
    refused = r"host pool needs .* GiB but only .* GiB of memory is available .*lower cache\.host\.size_gib"
    with pytest.raises(MemoryError, match=refused):
        HostPool(layout, 101, torch.float32, pin_memory=False)
    pool = HostPool(layout, 100, torch.float32, pin_memory=False)  # exactly what is available: fine
    assert pool.capacity_pages == 100
    monkeypatch.setattr(host_pool, "available_memory_bytes", lambda: None)  # no /proc/meminfo: not checked
    assert HostPool(layout, 1000, torch.float32, pin_memory=False).capacity_pages == 1000


def test_available_memory_reads_meminfo():
    from tiers.host_pool import available_memory_bytes

    available = available_memory_bytes()
    assert available is None or available > 0


def test_shared_buffer_is_seen_by_another_mapping_of_its_descriptor():
    import mmap
    import os

    buf, fd = pinned.shared_buffer(1 << 16)
    try:
        other = torch.frombuffer(mmap.mmap(fd, 1 << 16, flags=mmap.MAP_SHARED), dtype=torch.uint8)
        buf[1000:1010] = 42
        assert int(other[1000:1010].sum()) == 420 and int(other.sum()) == 420  # one memory, not a copy
    finally:
        os.close(fd)


def test_a_refused_registration_of_shared_memory_raises_instead_of_falling_back(monkeypatch):
    import os

    monkeypatch.setattr(pinned, "_register", lambda ptr, n: "cudaErrorNotPermitted")
    buf, fd = pinned.shared_buffer(4096)
    try:
        with pytest.raises(RuntimeError, match="shared host pool.*cudaErrorNotPermitted"):
            pinned.pinned_empty((1024,), torch.float32, shared=buf)
    finally:
        os.close(fd)


@pytest.mark.cuda
def test_shared_host_pool_is_pinned_and_copies_both_ways():
    from tiers import HostPool, KVLayout

    pool = HostPool(KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, page_size=16, itemsize=2), 8,
                    torch.bfloat16, shared=True)
    assert pool.pinned and pool.buffer.is_pinned() and pool.share_fd is not None
    src = torch.randn(pool.buffer.shape, device="cuda").bfloat16()
    pool.buffer.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(pool.buffer.to("cuda", non_blocking=True), src)
