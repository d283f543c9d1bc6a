"""Host -> GPU loads layer by layer (tiers/layered_copy.py) on CUDA: the bytes of a whole load, an event per
layer, a failure part-way that nothing can wait on, and layer groups that widen on a fragmented host pool."""

from __future__ import annotations

import pytest
import torch

from tiers import DevicePool, HostPool, KVLayout
from tiers.layered_copy import LayeredTransfer, layer_waits

pytestmark = [pytest.mark.cuda]

LAYOUT = KVLayout(num_layers=5, num_kv_heads=2, head_dim=64, page_size=16, itemsize=2)
# host pages in runs of 3, 1, 4, 2 ... and device pages descending: every chunk and run boundary is crossed
HOST_PAGES = [0, 1, 2, 10, 3, 4, 5, 6, 20, 21, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17]


def copier(mode: str, staging_pages: int = 3, layered: bool = True):
    pytest.importorskip("cupy")  # the layered loads need CuPy (and zero_copy its mapping)
    from tiers.cuda_copy import CudaPageCopier

    dev = DevicePool(LAYOUT, 64, torch.bfloat16, "cuda")
    host = HostPool(LAYOUT, 32, torch.bfloat16, pin_memory=True)
    # staging for `staging_pages` whole pages: a layer group's chunk holds num_layers / group times as many
    c = CudaPageCopier(dev, host, staging_bytes=staging_pages * LAYOUT.page_bytes, mode=mode, layered=layered)
    assert c.mode == mode and (c.layers is not None) == layered
    return dev, host, c


def fill(host: HostPool) -> torch.Tensor:
    data = torch.randn(32, *host.buffer.shape[1:]).to(torch.bfloat16)
    host.write_pages(list(range(32)), data)
    return data


@pytest.mark.parametrize("mode", ["dma", "zero_copy"])
def test_a_layered_load_lands_the_bytes_of_a_whole_load(mode):
    dev, host, c = copier(mode)
    data = fill(host)
    dev_pages = list(range(63, 63 - len(HOST_PAGES), -1))
    transfer = c.to_device(HOST_PAGES, dev_pages)
    assert isinstance(transfer, LayeredTransfer) and not transfer.failed
    assert len(transfer.layer_events) == LAYOUT.num_layers
    transfer.wait()
    assert all(e.query() for e in transfer.layer_events)
    assert torch.equal(dev.read_pages(dev_pages).cpu(), data[HOST_PAGES])
    _, _, whole = copier(mode, layered=False)
    assert not isinstance(whole.to_device([0], [0]), LayeredTransfer)


def test_a_fragmented_host_pool_gets_wider_layer_groups(monkeypatch):
    import tiers.layered_copy as lc

    monkeypatch.setattr(lc, "MAX_COPY_CALLS", 10)  # 6 runs x 5 layers = 30 calls: groups of 3 layers
    dev, host, c = copier("dma")
    data = fill(host)
    assert (len(lc._runs(HOST_PAGES, len(HOST_PAGES))) == 6 and c.layers.group_layers(6) == 3
            and c.layers.group_layers(1) == 1)
    dev_pages = list(range(len(HOST_PAGES)))
    transfer = c.to_device(HOST_PAGES, dev_pages)
    assert transfer.layer_events[0] is transfer.layer_events[2] is not transfer.layer_events[3]
    transfer.wait()
    assert torch.equal(dev.read_pages(dev_pages).cpu(), data[HOST_PAGES])


@pytest.mark.parametrize("mode", ["dma", "zero_copy"])
def test_a_load_that_fails_at_a_layer_keeps_the_layers_before_it_and_refuses_waits(mode):
    dev, host, c = copier(mode)
    data = fill(host)
    dev.kv.zero_()
    c.layers.fail_at_layer = 2
    transfer = c.to_device([0, 1, 2], [5, 6, 7])
    assert transfer.failed and len(transfer.layer_events) == 2
    transfer.wait()  # what was queued lands
    got = dev.read_pages([5, 6, 7]).cpu()
    assert torch.equal(got[:, :2], data[[0, 1, 2], :2]) and not got[:, 2:].any()
    with pytest.raises(RuntimeError, match="failed"):
        transfer.stream_wait_layer(0)


def test_a_forward_waits_for_each_layer_behind_a_slow_copy_stream():
    """The copy stream is held up (a spin kernel queued on it before the load): the compute stream's read of layer
    i, queued after `before_layer(i)`, sees the loaded bytes, not what the pool held before."""
    dev, host, c = copier("dma")
    data = fill(host)
    dev.kv.zero_()
    with torch.cuda.stream(c.layers.copy_stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the copy stream
    transfer = c.to_device([3, 4], [0, 1])
    before_layer = layer_waits([transfer])
    assert before_layer is not None
    seen = []
    for layer in range(LAYOUT.num_layers):
        before_layer(layer)
        seen.append(dev.kv[layer, :, :2].clone())  # on the compute stream, after its wait
    assert not transfer.done()  # the host queued every read without waiting
    torch.cuda.synchronize()
    for layer, got in enumerate(seen):
        assert torch.equal(got.permute(1, 0, 2, 3, 4).cpu(), data[[3, 4], layer])


def test_a_layered_load_does_not_queue_behind_backups():
    """Backups (GPU -> host copies) run on the copier's own streams: a load on the loader's lands while they are
    still held up (a spin kernel queued on the copier's copy stream stands for a burst of write-through)."""
    dev, host, c = copier("dma")
    data = fill(host)
    with torch.cuda.stream(c.copy_stream):
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s
        held_up = torch.cuda.Event()
        held_up.record()
    transfer = c.to_device([5, 6], [2, 3])
    transfer.wait()
    assert not held_up.query(), "the load waited for the copier's copy stream"
    assert torch.equal(dev.read_pages([2, 3]).cpu(), data[[5, 6]])
