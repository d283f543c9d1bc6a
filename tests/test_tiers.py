"""Pools, allocator and page copies between the GPU pool and the host pool (CPU tensors)."""

import pytest
import torch

from tiers import DevicePool, HostPool, KVLayout, MetadataPool, PageAllocator, PageCopier, make_copier
from tiers.cuda_copy import _runs


def test_allocator_detects_double_free_and_range():
    a = PageAllocator(4, "t")
    pages = a.allocate(3)
    assert pages == [0, 1, 2] and a.free_pages == 1 and a.used_pages == 3
    assert a.allocate(2) is None and a.free_pages == 1  # all or nothing
    a.free([1])
    with pytest.raises(RuntimeError, match="double free of page 1"):
        a.free([1])
    with pytest.raises(ValueError, match="out of range"):
        a.free([7])
    a.check_integrity([0, 2])
    with pytest.raises(AssertionError, match="free 2 \\+ owned 1"):
        a.check_integrity([0])
    with pytest.raises(AssertionError, match="owned twice"):
        a.check_integrity([0, 0])


def test_allocator_detects_double_allocation():
    a = PageAllocator(3, "t")
    a.allocate(1)
    a._free.append(0)  # corrupt the free list: page 0 is handed out again
    with pytest.raises(RuntimeError, match="allocated twice"):
        a.allocate(1)


def test_layouts_and_round_trip(layout: KVLayout):
    dev = DevicePool(layout, 6, torch.float32, "cpu")
    host = HostPool(layout, 5, torch.float32)
    assert dev.kv.shape == (2, 2, 6, 4, 2, 4)  # layer-first
    assert host.buffer.shape == (5, 2, 2, 4, 2, 4)  # page-first
    assert layout.page_bytes == 2 * 2 * 4 * 2 * 4 * 4 == host.page_view(0).numel()
    assert host.page_view(3).data_ptr() - host.page_view(0).data_ptr() == 3 * layout.page_bytes
    data = torch.randn(3, 2, 2, 4, 2, 4)
    dev.write_pages([5, 0, 3], data)
    assert torch.equal(dev.read_pages([5, 0, 3]), data)
    assert torch.equal(dev.kv[1, 0, 0], data[1, 1, 0])  # page 0 = data[1]: layer 1, K
    copier = make_copier(dev, host)
    assert type(copier) is PageCopier
    assert copier.to_host([5, 0, 3], [4, 1, 2]).done()
    assert torch.equal(host.read_pages([4, 1, 2]), data)
    dev.kv.zero_()
    copier.to_device([2, 4], [1, 2]).wait()
    assert torch.equal(dev.read_pages([1, 2]), data[[2, 0]])
    with pytest.raises(ValueError, match="2 device pages vs 1 host pages"):
        copier.to_host([0, 1], [0])


def test_metadata_pool_has_ids_only():
    pool = MetadataPool(3, 100)
    assert pool.allocate(3) == [0, 1, 2] and pool.used_pages() == 3 and pool.read_pages([0]) is None


def test_runs_coalesce_consecutive_pages():
    assert _runs([3, 4, 5, 9, 10, 2], 8) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs([0, 1, 2, 3], 2) == [(0, 0, 2), (2, 2, 2)]
    assert _runs([], 4) == []


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dma", "zero_copy"])
def test_cuda_copier_matches_reference(mode):
    from tiers.cuda_copy import CudaPageCopier

    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, itemsize=2)
    dev = DevicePool(layout, 64, torch.bfloat16, "cuda")
    host = HostPool(layout, 64, torch.bfloat16, pin_memory=True)
    try:
        copier = CudaPageCopier(dev, host, mode=mode)
    except RuntimeError as e:  # zero_copy needs CuPy to map the host pool
        pytest.skip(str(e))
    copier.chunk_pages = 5  # several double-buffered chunks
    data = torch.randn(20, 3, 2, 16, 2, 64).to(torch.bfloat16)
    host.write_pages(list(range(20)), data)
    dev_pages = list(range(63, 43, -1))
    copier.to_device([0, 1, 2, 3, 10, 11, 12, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17, 18, 19], dev_pages).wait()
    order = [0, 1, 2, 3, 10, 11, 12, 4, 5, 6, 7, 8, 9, 13, 14, 15, 16, 17, 18, 19]
    assert torch.equal(dev.read_pages(dev_pages).cpu(), data[order])
    copier.to_host(dev_pages, list(range(40, 60))).wait()
    assert torch.equal(host.read_pages(list(range(40, 60))), data[order])


def test_freed_runs_are_handed_out_again_as_ascending_runs():
    """The copiers move consecutive ascending host pages in one copy, so a freed run must come back as one."""
    alloc = PageAllocator(16)
    first = alloc.allocate(8)
    assert first == list(range(8))
    alloc.free(first[2:6])  # eviction frees a node's pages
    assert alloc.allocate(4) == [2, 3, 4, 5]
    alloc.free([7, 6, 5])  # in any order
    assert alloc.allocate(3) == [5, 6, 7]


@pytest.mark.cuda
def test_cuda_copier_puts_nothing_on_the_compute_stream():
    """A second load's page-id upload must not queue on the compute stream behind the first load's copies
    (copy engines serve copies in submission order): compute work queued after both loads runs at once."""
    from tiers.cuda_copy import CudaPageCopier

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, page_size=64, itemsize=2)  # 8 MiB pages
    dev = DevicePool(layout, 262, torch.bfloat16, "cuda")
    host = HostPool(layout, 262, torch.bfloat16, pin_memory=True)
    copier = CudaPageCopier(dev, host, mode="dma")
    # first uses happen here, not while the copies below are in flight: lazy kernel loading, and the copier's
    # first pinned page-id buffers (a fresh pinned allocation may wait for the device): without this warm-up the
    # test failed once, run cold as the first CUDA work on a fresh H200
    marker = torch.ones(4, device="cuda") * 2
    copier.to_device([258, 259], [258, 259]).wait()
    torch.cuda.synchronize()
    big = copier.to_device(list(range(256)), list(range(256)))  # 2 GiB: tens of ms over PCIe
    copier.to_device([256, 257], [256, 257])
    marker = torch.ones(4, device="cuda") * 2
    ran = torch.cuda.Event()
    ran.record()
    ran.synchronize()
    assert not big.done(), "compute-stream work waited for the first load's copies"
    big.wait()
    assert float(marker.sum()) == 8.0


class _FenceRecorder:
    """A copier that records the `after` fence each copy was given (fences are numbered marks)."""

    def __init__(self):
        self.marks = 0
        self.calls: list[tuple[str, object]] = []

    def fence(self) -> int:
        self.marks += 1
        return self.marks

    def to_device(self, host_pages, device_pages, after=None):
        self.calls.append(("to_device", after))

    def to_host(self, device_pages, host_pages, after=None):
        self.calls.append(("to_host", after))


def test_launch_later_pinned_fence_covers_loads_and_backups_until_launch():
    """pin_fence(): loads and backups asked for before the next launch() wait for the pinned fence (1), not for a
    fence of their own; launch() drops the pin, so later loads take fresh fences and backups wait as usual."""
    from tiers import LaunchLater

    inner = _FenceRecorder()
    copier = LaunchLater(inner)
    copier.to_device([0], [0])  # unpinned: its own fence, 1
    copier.pin_fence()  # 2
    copier.to_device([1], [1])
    copier.to_host([2], [2])
    assert inner.calls == [("to_host", 2)]  # backups pass straight through, with the pinned fence
    assert copier.launch() == 2
    assert inner.calls[1:] == [("to_device", 1), ("to_device", 2)]
    copier.to_host([3], [3])
    copier.to_device([4], [4])  # a fresh fence, 3
    copier.launch()
    assert inner.calls[3:] == [("to_host", None), ("to_device", 3)]


def test_launch_later_holds_loads_until_launched(layout: KVLayout):
    """LaunchLater: a load is not done, and its bytes are not moved, before launch(); launch() starts every held
    load in order; waiting on a held load launches it; backups pass straight through."""
    from tiers import LaunchLater

    dev = DevicePool(layout, 8, torch.float32, "cpu")
    host = HostPool(layout, 8, torch.float32, pin_memory=False)
    copier = LaunchLater(PageCopier(dev, host))
    data = torch.randn(4, *host.buffer.shape[1:])
    host.write_pages([0, 1, 2, 3], data)
    first = copier.to_device([0, 1], [5, 6])
    second = copier.to_device([2, 3], [1, 0])
    assert copier.held == 2 and not first.done() and not second.done()
    assert torch.count_nonzero(dev.read_pages([5, 6, 1, 0])) == 0  # nothing moved yet
    assert copier.launch() == 2
    assert copier.held == 0 and first.done() and second.done()
    assert torch.equal(dev.read_pages([5, 6, 1, 0]), data)
    assert copier.launch() == 0 and (copier.launches, copier.launched_loads) == (1, 2)
    third = copier.to_device([3], [7])
    third.wait()  # waiting launches it
    assert copier.held == 0 and third.done() and torch.equal(dev.read_pages([7]), data[3:4])
    assert copier.to_host([5], [6]).done()  # not held
    assert torch.equal(host.read_pages([6]), data[0:1])
    with pytest.raises(ValueError, match="2 host pages vs 1 device pages"):
        copier.to_device([0, 1], [2])  # refused when asked for, not at launch
    assert copier.held == 0


def _small_cuda_copier():
    """A DMA copier over 8-page bf16 pools of a small layout."""
    from tiers.cuda_copy import CudaPageCopier

    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, page_size=16, itemsize=2)
    dev = DevicePool(layout, 8, torch.bfloat16, "cuda")
    host = HostPool(layout, 8, torch.bfloat16, pin_memory=True)
    return dev, host, CudaPageCopier(dev, host, mode="dma")


def _long_compute_chain() -> torch.cuda.Event:
    """Queue float32 matmuls (hundreds of ms) on the compute stream; the returned event follows them."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(40):
        x = x @ x / 64
    chain = torch.cuda.Event()
    chain.record()
    return chain


@pytest.mark.cuda
def test_cuda_load_after_a_fence_does_not_wait_for_later_compute():
    """A load started with `after=fence()` waits for the compute queued before the fence only: queued behind a
    long matmul chain it still lands first, with the right bytes. Without a fence it waits for the chain."""
    dev, host, copier = _small_cuda_copier()
    data = torch.randn(4, *host.buffer.shape[1:]).to(torch.bfloat16)
    host.write_pages([0, 1, 2, 3], data)
    fence = copier.fence()
    chain = _long_compute_chain()
    fenced = copier.to_device([0, 1], [4, 5], after=fence)
    fenced.wait()
    assert not chain.query(), "the fenced load waited for compute queued after its fence"
    unfenced = copier.to_device([2, 3], [6, 7])
    unfenced.wait()
    assert chain.query()
    assert torch.equal(dev.read_pages([4, 5, 6, 7]).cpu(), data)


@pytest.mark.cuda
def test_cuda_backup_after_a_fence_does_not_wait_for_later_compute():
    """A backup started with `after=fence()` saves pages written before the fence without waiting for compute
    queued after it (admit_during_forward's backups run while a forward does), and saves the right bytes."""
    dev, host, copier = _small_cuda_copier()
    data = torch.randn(2, *host.buffer.shape[1:]).to(torch.bfloat16)
    host.write_pages([0, 1], data)
    copier.to_device([0, 1], [2, 3]).wait()
    fence = copier.fence()
    chain = _long_compute_chain()
    saved = copier.to_host([2, 3], [4, 5], after=fence)
    saved.wait()
    assert not chain.query(), "the fenced backup waited for compute queued after its fence"
    assert torch.equal(host.read_pages([4, 5]), data)
    torch.cuda.synchronize()
