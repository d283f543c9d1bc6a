"""Many requests at once through the controller, with copies that land late and an L3 queue that refuses at random:
every page a request reads must hold the bytes computed for it.

A copy moves its bytes only when it lands (as a GPU copy does), so a page the controller freed or handed to someone
else while a copy still read or filled it shows up as wrong bytes. The interleavings are random but seeded; the
assertions hold for any of them.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from memory_l3 import MemoryL3
from test_controller import LAYOUT, page_value

from controller import CostModel, L3Worker, TierController, WritePolicy
from radix import RadixTree
from tiers import DevicePool, HostPool, PageCopier


class LateCopier(PageCopier):
    """Copies whose bytes move when they land: at `wait()`, or when the test lands them (`land_some`)."""

    class Handle:
        def __init__(self, move):
            self.move, self.landed, self.lock = move, False, threading.Lock()

        def done(self):
            return self.landed

        def wait(self):  # also from an L3 writer thread (a write's `before`)
            with self.lock:
                if not self.landed:
                    self.move()
                    self.landed = True

    def __init__(self, *args):
        super().__init__(*args)
        self.pending: list[LateCopier.Handle] = []

    def _late(self, move) -> Handle:
        handle = self.Handle(move)
        self.pending.append(handle)
        return handle

    def to_host(self, device_pages, host_pages, after=None):
        device_pages, host_pages = list(device_pages), list(host_pages)
        return self._late(lambda: PageCopier.to_host(self, device_pages, host_pages))

    def to_device(self, host_pages, device_pages, after=None):
        host_pages, device_pages = list(host_pages), list(device_pages)
        return self._late(lambda: PageCopier.to_device(self, host_pages, device_pages))

    def land_some(self, rng: random.Random, share: float) -> None:
        keep = []
        for handle in self.pending:
            if rng.random() < share:
                handle.wait()
            elif not handle.landed:
                keep.append(handle)
        self.pending = keep


class MoodyWorker(L3Worker):
    """A synchronous worker whose write queue is full at random (the writes then wait in the controller)."""

    def __init__(self, store, rng: random.Random):
        super().__init__(store, synchronous=True, queue_pages=6)
        self.rng = rng

    def submit_write(self, token, keys, pages, before=None):
        if self.rng.random() < 0.3:
            return False
        return super().submit_write(token, keys, pages, before)


def _family(rng: random.Random) -> list[tuple[int, ...]]:
    """Prompts that share prefixes: a few roots, each grown by turns (an agent session's shape)."""
    ps = LAYOUT.page_size
    prompts = []
    for root in range(4):
        tokens = [root * 10_000 + i for i in range(ps * rng.randint(1, 3))]
        for turn in range(5):
            tokens += [root * 10_000 + 1_000 * (turn + 1) + i for i in range(ps * rng.randint(1, 2))]
            prompts.append((*tokens, 7))  # one token past the last full page, left to compute
    return prompts


@pytest.mark.parametrize("host_to_disk", ["write_through", "write_back"])
@pytest.mark.parametrize("seed", range(6))
def test_every_page_read_holds_its_bytes_under_late_copies_and_a_refusing_queue(seed, host_to_disk):
    rng = random.Random(seed)
    host = HostPool(LAYOUT, 6, torch.float32)
    l3 = MemoryL3(40, LAYOUT.page_bytes)
    _stress(rng, host, l3, MoodyWorker(l3, rng), seed, host_to_disk)


@pytest.mark.parametrize("seed", range(2))
def test_the_same_with_the_l3_in_a_process_of_its_own(tmp_path, seed):
    from tiers.l3.process import L3Process

    rng = random.Random(seed)
    host = HostPool(LAYOUT, 6, torch.float32, shared=True)
    args = dict(path=str(tmp_path / "l3"), capacity_bytes=40 * 4096, page_bytes=LAYOUT.page_bytes,
                namespace=b"controller-stress"[:16], io_backend="buffered", io_threads=2, sync_batch_pages=2)
    process = L3Process(host, args, threads=2, queue_pages=4, batch_pages=2)
    try:
        _stress(rng, host, process.store, process.worker, seed)
    finally:
        process.store.close()


@pytest.mark.parametrize("seed", range(4))
def test_the_same_with_gaps_computed_while_the_tail_loads(seed):
    """Load overlap on: some tickets compute pages [k, s) of their prefix while [s, n) loads."""
    rng = random.Random(seed)
    host = HostPool(LAYOUT, 6, torch.float32)
    l3 = MemoryL3(40, LAYOUT.page_bytes)
    pb = LAYOUT.page_bytes  # 1 s to compute a page, 0.25 s to load one from host, 3 s from disk
    cost = CostModel(LAYOUT.page_size, pb, "auto", float(LAYOUT.page_size), pb * 4.0, pb / 3.0, adaptive=False,
                     overlap=True)
    _stress(rng, host, l3, MoodyWorker(l3, rng), seed, cost=cost)


def _stress(rng: random.Random, host: HostPool, l3, worker, seed: int, host_to_disk: str = "write_through",
            cost: CostModel | None = None) -> None:
    dev = DevicePool(LAYOUT, 14, torch.float32, "cpu")
    copier = LateCopier(dev, host)
    # every page written (l3_admit all), also where the cost model would recompute it: the gaps need disk pages
    policy = WritePolicy("write_through", host_to_disk, 2, 1.0, l3_admit="all")
    ctrl = TierController(RadixTree(LAYOUT.page_size), dev, host, l3, copier, policy, cost, worker)
    gaps = 0
    prompts = _family(rng)
    ps = LAYOUT.page_size
    running: list = []
    served = 0

    def settle(ticket, prefix_only=False):
        """Wait for the ticket's loads (only those before its gap): disk reads complete at poll, copies land when
        waited for."""
        ready = ticket.prefix_ready if prefix_only else ticket.ready
        for _ in range(200):
            if ready():
                break
            assert worker.wait_idle(10)
            ctrl.poll()
            for node in ticket.prefix_nodes if prefix_only else ticket.nodes:
                ctrl.transfers.wait(node)
        assert ready() and not ticket.failed

    def finish(ticket, tokens):
        nonlocal served, gaps
        if ticket.gap is not None:  # the engine computes the gap's pages, after [0, k), while the tail loads
            k, s = ticket.gap
            settle(ticket, prefix_only=True)  # the tail may still be loading
            for i, p in enumerate(ticket.prefix_pages()):
                assert torch.all(dev.kv[:, :, p] == page_value(tokens, i)), f"seed {seed}: page {i} has wrong bytes"
            pages = ctrl.alloc_device(s - k)
            if pages is None:  # no room for the gap: give the ticket up once its loads settle, as a preemption
                settle(ticket)
                ctrl.release(ticket)
                return
            for i, p in enumerate(pages):
                dev.kv[:, :, p] = page_value(tokens, k + i)
            ctrl.commit_gap(ticket, tokens, pages)
            gaps += 1
        settle(ticket)
        for i, p in enumerate(ticket.device_pages()):
            assert torch.all(dev.kv[:, :, p] == page_value(tokens, i)), f"seed {seed}: page {i} has wrong bytes"
        served += ticket.num_pages
        full = len(tokens) // ps
        new = ctrl.alloc_device(full - ticket.num_pages)
        if new is not None:
            for i, p in enumerate(new):
                dev.kv[:, :, p] = page_value(tokens, ticket.num_pages + i)
            ctrl.commit(ticket, tokens[: full * ps], ticket.device_pages() + new)
        ctrl.release(ticket)
        ctrl.check_integrity()

    holds: list = []  # prefetches for queued requests: (hold, tokens)
    for _ in range(200):
        action = rng.random()
        if action < 0.4 and len(running) < 2:
            if holds and rng.random() < 0.5:  # a queued request is admitted: its prefetch hold goes to its ticket
                hold, tokens = holds.pop(0)
                ticket = ctrl.acquire(tokens, max_pages=(len(tokens) - 1) // ps, overlap=cost is not None)
                ctrl.release_prefetch(hold)
            else:
                tokens = rng.choice(prompts)
                ticket = ctrl.acquire(tokens, max_pages=(len(tokens) - 1) // ps, overlap=cost is not None)
            running.append((ticket, tokens))
        elif action < 0.65 and running:
            finish(*running.pop(rng.randrange(len(running))))
        elif action < 0.75 and len(holds) < 2:
            tokens = rng.choice(prompts)
            holds.append((ctrl.prefetch(tokens, max_pages=(len(tokens) - 1) // ps), tokens))
        elif action < 0.8 and holds:
            hold, tokens = holds[0]
            ctrl.prefetch(tokens, max_pages=(len(tokens) - 1) // ps, hold=hold)  # asked again, as each step does
        else:
            copier.land_some(rng, 0.5)
            ctrl.poll()
        ctrl.check_integrity()
    for hold, _ in holds:
        ctrl.release_prefetch(hold)
    for ticket, tokens in running:
        finish(ticket, tokens)
    copier.land_some(rng, 1.0)
    ctrl.close()
    copier.land_some(rng, 1.0)  # close's last completions may start copies (a retried backup): their bytes land here
    assert served > 0 and ctrl.stats.hit_tokens["disk"] + ctrl.stats.hit_tokens["host"] > 0
    assert ctrl.loads.prefetching == 0
    assert cost is None or gaps > 0, "no ticket had a gap: the overlap path went untested"
    # what every tier holds now is what was computed for it
    tree = ctrl.tree
    for node in tree.nodes():
        tokens = tree.path_tokens(node)
        first = len(tokens) // ps - node.num_pages
        for j in range(node.num_pages):
            want = page_value(tuple(tokens), first + j)
            if node.on_device:
                assert torch.all(dev.kv[:, :, node.device_pages[j]] == want)
            if node.on_host:
                assert torch.all(host.buffer[node.host_pages[j]] == want)
            if node.on_disk and isinstance(l3, MemoryL3) and node.disk_keys[j] in l3.data:
                got = torch.frombuffer(bytearray(l3.data[node.disk_keys[j]]), dtype=torch.float32)
                assert torch.all(got == want)
