"""The leader's lockstep proxies and a follower's op application, in one process: byte moves become ops that
name pages by id, a read's or write's completion waits for every rank with the results ANDed, writes count as
queued until every rank has finished them, and a follower applying the ops moves its own bytes the same way."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/memory_l3.py

from memory_l3 import MemoryL3  # noqa: E402

from hicache.cache import RankTiers  # noqa: E402
from hicache.engine.tp.follower import PlanOps  # noqa: E402
from hicache.engine.tp.ports import LockstepCopier, LockstepL3, LockstepWorker, host_page_of  # noqa: E402
from hicache.sizes import ResolvedSizes  # noqa: E402
from tiers import DevicePool, HostPool, KVLayout  # noqa: E402
from tiers.copy import PageCopier  # noqa: E402
from tiers.l3.worker import L3Worker  # noqa: E402

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=2, itemsize=4)


def rank_tiers(queue_pages: int = 8) -> RankTiers:
    device = DevicePool(LAYOUT, 8, torch.float32, "cpu")
    host = HostPool(LAYOUT, 8, torch.float32, pin_memory=False)
    store = MemoryL3(16, LAYOUT.page_bytes)
    worker = L3Worker(store, queue_pages=queue_pages, synchronous=True)
    sizes = ResolvedSizes(2, LAYOUT.page_bytes, 8, 8, 16)
    return RankTiers(sizes, b"\0" * 16, device, host, PageCopier(device, host), store, worker)


class Leader:
    """Rank 0's proxies over its tiers, with the ops they record and an exchange that asks nothing."""

    def __init__(self, queue_pages: int = 8) -> None:
        self.tiers = rank_tiers(queue_pages)
        self.ops: list[tuple] = []
        self.lost = False
        self.exchanges = 0
        self.copier = LockstepCopier(self.tiers.copier, self.ops.append)
        self.l3 = LockstepL3(self.tiers.l3, self.ops.append)
        self.worker = LockstepWorker(self.tiers.worker, self.tiers.host, [1], self.ops.append, self._exchange,
                                     lambda: self.lost, timeout_s=5.0)

    def _exchange(self) -> None:
        self.exchanges += 1

    def views(self, pages: list[int]) -> list[torch.Tensor]:
        return [self.tiers.host.page_view(p) for p in pages]


def fill(pool, pages: list[int], value: float) -> None:
    pool.write_pages(pages, torch.full((len(pages), *pool.read_pages([0]).shape[1:]), value))


def test_host_page_of_reads_the_page_id_from_the_buffer_address():
    host = rank_tiers().host
    assert [host_page_of(host, host.page_view(p)) for p in (0, 3, 7)] == [0, 3, 7]
    with pytest.raises(ValueError, match="not a page of the host pool"):
        host_page_of(host, torch.zeros(LAYOUT.page_bytes, dtype=torch.uint8))


def test_copies_deletes_and_sightings_are_ops_naming_pages_and_keys():
    leader = Leader()
    fill(leader.tiers.device, [2, 3], 5.0)
    leader.copier.to_host([2, 3], [6, 7])
    leader.copier.to_device([6], [1])
    leader.copier.to_host([], [])  # nothing moved: no op
    leader.l3.delete([b"k" * 16])
    assert not hasattr(leader.l3, "note_hit")  # MemoryL3 has no admission rule: the controller must not find one
    assert leader.ops == [("to_host", [2, 3], [6, 7]), ("to_device", [6], [1]), ("delete", [b"k" * 16])]
    assert torch.equal(leader.tiers.device.read_pages([1]), leader.tiers.device.read_pages([2]))  # done on rank 0


def test_a_read_completes_once_every_rank_reported_it_with_the_results_anded():
    leader = Leader()
    keys = [b"a" * 16, b"b" * 16]
    assert leader.tiers.l3.write_pages(keys, leader.views([0, 1])) == [True, True]
    leader.worker.submit_read("node", keys, leader.views([4, 5]))
    (op,) = [o for o in leader.ops if o[0] == "read"]
    assert op[2:] == (keys, [4, 5])
    assert leader.worker.completions() == []  # rank 0's read is done, rank 1's not reported
    assert leader.worker.awaiting()
    leader.worker.receive(1, [(op[1], [True, False])])
    (c,) = leader.worker.completions()
    assert (c.kind, c.token, c.results) == ("read", "node", [True, False])  # failed where any rank failed
    assert not leader.worker.awaiting() and leader.worker.completions() == []


def test_writes_count_as_queued_until_every_rank_finished_them():
    leader = Leader(queue_pages=4)
    keys = [bytes([i]) * 16 for i in range(3)]
    assert leader.worker.submit_write("w1", keys, leader.views([0, 1, 2]))
    assert leader.tiers.worker.queued_write_pages == 0  # rank 0's own write is done (synchronous) ...
    assert leader.worker.queued_write_pages == 3  # ... but rank 1's may not be: the queue still holds it
    assert not leader.worker.submit_write("w2", [b"x" * 16, b"y" * 16], leader.views([3, 4]))  # 3 + 2 > 4
    assert [o[0] for o in leader.ops] == ["write"]
    leader.worker.receive(1, [(leader.ops[0][1], [True, True, True])])
    (c,) = leader.worker.completions()
    assert (c.token, c.results) == ("w1", [True, True, True])
    assert leader.worker.queued_write_pages == 0


def test_a_staged_write_names_the_host_pages_it_copied():
    leader = Leader()
    staged = leader.worker.stage(leader.views([5, 6]))
    assert leader.worker.submit_write("w", [b"s" * 16, b"t" * 16], staged)
    assert leader.ops == [("write", 0, [b"s" * 16, b"t" * 16], [5, 6], True)]


def test_once_the_group_is_lost_missing_reports_count_as_failures():
    leader = Leader()
    leader.worker.submit_read("node", [b"a" * 16], leader.views([0]))  # not in the store: fails on rank 0 too
    leader.worker.submit_write("w", [b"b" * 16], leader.views([1]))
    leader.lost = True
    assert leader.worker.wait_idle(1.0) and leader.exchanges == 0  # no exchange with a lost group
    done = {c.token: c.results for c in leader.worker.completions()}
    assert done == {"node": [False], "w": [False]}


def test_wait_idle_exchanges_until_every_rank_reported():
    leader = Leader()
    leader.worker.submit_write("w", [b"b" * 16], leader.views([1]))
    op = leader.ops[0][1]
    leader.worker.exchange = lambda: leader.worker.receive(1, [(op, [True])])  # the report comes with a plan
    assert leader.worker.wait_idle(5.0)
    assert [(c.token, c.results) for c in leader.worker.completions()] == [("w", [True])]


def test_a_follower_applying_the_ops_moves_its_own_bytes_the_same_way():
    """Rank 0's calls, recorded, then applied to rank 1's tiers (whose bytes differ: another head shard): rank 1's
    pages end where rank 0's ops put them, and its L3 holds its own bytes under rank 0's keys."""
    leader, follower = Leader(), rank_tiers()
    fill(leader.tiers.device, [0, 1], 1.0)
    fill(follower.device, [0, 1], 2.0)
    keys = [b"p" * 16, b"q" * 16]
    leader.copier.to_host([0, 1], [3, 4])  # GPU -> host backup
    assert leader.worker.submit_write("w", keys, leader.views([3, 4]))  # host -> L3 write-through
    leader.worker.submit_read("r", keys, leader.views([6, 7]))  # back from L3 into other host pages
    leader.copier.to_device([6, 7], [5, 6])  # and onto the GPU
    ops = PlanOps(follower)
    ops.apply(leader.ops)
    reports = dict(ops.finished())
    assert reports == {0: [True, True], 1: [True, True]}
    assert torch.equal(follower.device.read_pages([5, 6]), torch.full_like(follower.device.read_pages([5, 6]), 2.0))
    assert torch.equal(leader.tiers.device.read_pages([5, 6]),
                       torch.full_like(leader.tiers.device.read_pages([5, 6]), 1.0))
    assert set(follower.l3.data) == set(keys) and follower.l3.data[keys[0]] != leader.tiers.l3.data[keys[0]]


def test_a_follower_that_cannot_queue_a_write_reports_it_failed():
    follower = rank_tiers(queue_pages=1)
    ops = PlanOps(follower)
    ops.apply([("write", 9, [b"a" * 16, b"b" * 16], [0, 1], False)])  # 2 pages > its queue of 1
    assert ops.finished() == [(9, [False, False])]


def test_a_followers_loads_are_waited_for_per_layer_by_its_forward_then_before_the_next_plan():
    """A follower keeps its plan's loads for the forward's per-layer waits (tiers/layered_copy.py) and waits for
    them itself only once that forward is queued, so that none outlives its plan."""
    from tiers.layered_copy import layer_waits

    events: list[tuple[str, int]] = []

    class Streaming:
        streams = True

        def stream_wait_layer(self, layer: int, stream=None) -> None:
            events.append(("layer", layer))

        def wait(self) -> None:
            events.append(("wait", -1))

    follower = rank_tiers()
    follower.copier = type("Copier", (), {"to_device": lambda self, h, d: Streaming()})()
    ops = PlanOps(follower)
    ops.apply([("to_device", [6, 7], [5, 6])])
    assert len(ops.loads) == 1 and events == []  # applying the plan waits for nothing
    before_layer = layer_waits(ops.loads)
    assert before_layer is not None
    for layer in range(3):
        before_layer(layer)
    ops.settle_loads()
    assert events == [("layer", 0), ("layer", 1), ("layer", 2), ("wait", -1)] and ops.loads == []
