"""The controller's transfer state: what is in flight for each tree node, kept beside the tree.

The radix tree records where pages live; this table records what is moving them. Per node it holds
one transfer: a copy handle (host -> GPU), a `DiskLoad` (an L3 -> host read in flight), or a marker
(`FAILED`, `PREFETCHED`). It also holds the in-flight sets the controller's parts share: nodes whose
L3 read or write is queued, GPU pages whose backup copy may still be reading them, and nodes whose
data proved bad and are removed once nobody holds them.

A split node's transfer belongs to both parts (the tree calls `_split`). A finished copy carries no
information, so `ready` drops it; the markers stay until the node is loaded again or removed. `staged` names the
nodes copied to the GPU for a queued request (controller/staging.py) and not used since: a request that finds
them on the GPU was served them from host memory.
"""

from __future__ import annotations

from typing import Any

from radix import RadixTree, TreeNode
from tiers.copy import CompletedTransfer, TransferHandle


class Marker(CompletedTransfer):
    """A node state that, like a finished transfer, has nothing to wait for."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


# the node's data could not be loaded; it will be removed
FAILED = Marker("FAILED")
# the node's host copy was read from L3 for a queued request and has not been loaded since (so the request's
# hit counts as a disk hit: the bytes came from L3)
PREFETCHED = Marker("PREFETCHED")


class AllTransfers:
    """Several copies in flight as one handle."""

    def __init__(self, handles: list[TransferHandle]):
        self.handles = handles

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def wait(self) -> None:
        for h in self.handles:
            h.wait()


class InFlight:
    """Whether transfers are still in flight, each handle asked once: one batched copy's handle covers every page
    of the batch, and asking it per page queried the GPU (a CUDA event) thousands of times a step when a long
    prompt's pages were freed."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: dict[int, tuple[TransferHandle, bool]] = {}  # the handle is kept: its id stays its own

    def __call__(self, handle: TransferHandle) -> bool:
        seen = self._seen.get(id(handle))
        if seen is None:
            seen = self._seen[id(handle)] = (handle, not handle.done())
        return seen[1]


class PendingCopy:
    """A host -> GPU copy asked for but not started yet (Loads.acquire starts a prefix's copies in one call once
    all its nodes have their pages): like a copy in flight, it keeps the node's host pages from eviction."""

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        raise RuntimeError("wait on a copy that has not been started")


PENDING_COPY = PendingCopy()


class DiskLoad:
    """An L3 -> host read in flight for a node.

    `to_device`: the read continues to the node's GPU pages (a request's load); a prefetch for a queued
    request stops in host memory unless a request claims the node before the read lands. `prefetch`: it lands
    as a prefetched host copy: started for a queued request (its node is pinned by a PrefetchHold; a request's
    loads are locked by its ticket), or given up by the request that started it (controller/give_up.py).
    `for_request`: started by a request's ticket, not by a hold (host staging counts it apart).
    `eta`: when the read is expected to land (monotonic seconds; the cost model's view of the disk queue).
    """

    def __init__(self, host_pages: list[int], to_device: bool = True, prefetch: bool = False, eta: float = 0.0):
        self.host_pages = host_pages
        self.to_device = to_device
        self.prefetch = prefetch
        self.for_request = not prefetch
        self.held = False  # counted as held by the prefetch hold that started it (Loads.staged_pages)
        self.eta = eta

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        raise RuntimeError("wait on a disk load: wait for the L3 worker and poll the controller instead")


class Transfers:
    """Per-node transfer state and the in-flight sets (see the module doc). Engine thread only."""

    def __init__(self, tree: RadixTree):
        self._of: dict[TreeNode, Any] = {}
        self.loading: dict[int, TreeNode] = {}  # node id -> node with an L3 read in flight
        self.writing: dict[int, TreeNode] = {}  # node id -> node with an L3 write in flight
        self.bounced: set[int] = set()  # node ids whose L3 write carries its own copy of the bytes
        self.backups: dict[int, TransferHandle] = {}  # GPU page -> its latest GPU -> host copy (may be in flight)
        # host page -> the GPU -> host copy filling it (may be in flight; kept after the GPU page is freed, which
        # only makes the GPU wait): a disk write of the page must wait for it. Done handles are left to be
        # overwritten when the page is filled again; at most one per host page.
        self.host_fills: dict[int, TransferHandle] = {}
        self.invalid: dict[int, TreeNode] = {}  # nodes whose data is bad, removed once unlocked and unpinned
        # node id -> the read of a node the tree removed while it was in flight (an ancestor's last copy left): the
        # read still writes into its host pages, which go back when it completes (Loads.apply)
        self.orphan_reads: dict[int, DiskLoad] = {}
        # nodes staged on the GPU for a queued request (controller/staging.py), until a ticket uses them or their GPU
        # pages go (`clear`): the tier their hits count in (host, or disk for a copy prefetched from L3)
        self.staged: dict[TreeNode, str] = {}
        tree.split_listeners.append(self._split)

    def get(self, node: TreeNode) -> Any:
        """The node's transfer, or None."""
        return self._of.get(node)

    def set(self, node: TreeNode, transfer: Any) -> None:
        self._of[node] = transfer

    def clear(self, node: TreeNode) -> None:
        self._of.pop(node, None)
        self.staged.pop(node, None)

    def disk_load(self, node: TreeNode) -> DiskLoad | None:
        t = self._of.get(node)
        return t if isinstance(t, DiskLoad) else None

    def reading(self, node: TreeNode) -> DiskLoad:
        """The disk read of a node known to be reading (one of `loading`); ValueError names it where it is not."""
        t = self._of.get(node)
        if not isinstance(t, DiskLoad):
            raise ValueError(f"{node} has no disk read in flight")
        return t

    def failed(self, node: TreeNode) -> bool:
        """Whether the node's load failed (a ticket holding it must give it up): a disk read that failed
        verification, or a layered copy whose issuing failed part-way (tiers/layered_copy.py)."""
        t = self._of.get(node)
        return t is FAILED or getattr(t, "failed", False) is True

    def unusable(self, node: TreeNode) -> bool:
        """Whether a match must stop before the node: its load failed or its data is bad."""
        return self.failed(node) or node.id in self.invalid

    def prefetched(self, node: TreeNode) -> bool:
        return self._of.get(node) is PREFETCHED

    def ready(self, node: TreeNode) -> bool:
        """Whether the node's pages may be used now (nothing in flight, or it finished)."""
        t = self._of.get(node)
        if t is None:
            return True
        if not t.done():
            return False
        if getattr(t, "failed", False) is True:  # a layered copy that failed part-way, settled: its pages go
            self._of[node] = FAILED
            self.mark_invalid(node)
        elif not isinstance(t, Marker):
            del self._of[node]  # a finished copy: nothing left to know
        return True

    def usable(self, node: TreeNode) -> bool:
        """Whether a forward may read the node's pages now: they are ready, or a layered copy brings them and the
        forward waits for each layer of it on the GPU (`in_flight_copy`; tiers/layered_copy.py)."""
        t = self._of.get(node)
        return getattr(t, "streams", False) is True and not getattr(t, "failed", False) or self.ready(node)

    def in_flight_copy(self, node: TreeNode) -> TransferHandle | None:
        """The host -> GPU copy still bringing the node's pages, if any (a disk read or a marker is not one)."""
        t = self._of.get(node)
        if t is None or isinstance(t, (Marker, DiskLoad, PendingCopy)) or t.done():
            return None
        handle: TransferHandle = t
        return handle

    def wait(self, node: TreeNode) -> None:
        """Block the host until the node's copy has landed (not for disk loads: see `disk_load`)."""
        t = self._of.get(node)
        if t is not None and t is not FAILED:
            t.wait()

    def mark_invalid(self, node: TreeNode) -> None:
        self.invalid[node.id] = node

    def forget(self, node: TreeNode) -> None:
        """Drop a removed node's entries (a read in flight is kept aside until it completes: `orphan_reads`)."""
        transfer = self._of.pop(node, None)
        self.staged.pop(node, None)
        if node.id in self.loading and isinstance(transfer, DiskLoad):
            self.orphan_reads[node.id] = transfer
        self.invalid.pop(node.id, None)

    def in_flight(self) -> int:
        """Nodes with a transfer still moving their pages (a settled controller has none)."""
        return sum(1 for t in self._of.values() if not t.done()) + len(self.loading) + len(self.writing)

    def _split(self, upper: TreeNode, lower: TreeNode) -> None:
        t = self._of.get(lower)
        if t is not None:
            self._of[upper] = t
        if lower in self.staged:
            self.staged[upper] = self.staged[lower]
