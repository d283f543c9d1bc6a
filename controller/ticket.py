"""A request's claim on a cached prefix (LoadTicket) and a queued request's prefetch (PrefetchHold)."""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.transfers import Transfers
from radix import TreeNode


@dataclass
class PrefetchHold:
    """What `TierController.prefetch` holds for a queued request: nodes pinned in host memory (or on
    their way there) until the request is admitted and calls `release_prefetch`."""

    pins: list[tuple[TreeNode, int]] = field(default_factory=list)  # (pinned node, pages this hold read)
    started: int = 0  # pages whose L3 reads this hold started
    short: bool = False  # stopped for lack of host room: `prefetch(..., hold=this)` may take more later
    queue_bound: bool = False  # short because the disk's read queue was full (prefetch_queue_s), not host memory
    room_version: int = -1  # the controller's host_room_version when it was last asked

    @property
    def pages(self) -> int:
        """Pages held (read by this hold or by another)."""
        return sum(node.num_pages for node, _ in self.pins)


@dataclass
class LoadTicket:
    """A request's claim on a cached prefix: the deepest locked node and the loads it waits for.

    The prefix is the path from the root to `node`, recomputed on each use: another request's match
    may split a node on a locked path, which adds nodes to the path but never moves its end.

    With a `gap` (k, s), pages [k, s) of the prefix are not loaded: the caller computes them into its
    own pages (after [0, k) is ready: `prefix_ready`) while [s, n) loads, then hands them over with
    `TierController.commit_gap`; pages past n need all of it (`ready`). Node boundaries at k and s
    stay put (nodes are split, never merged), so the parts are found by page position.
    """

    transfers: Transfers  # the controller's transfer state, which says when the prefix's pages have landed
    node: TreeNode  # deepest locked node (its namespace's root when nothing is cached)
    matched_pages: int  # pages the tree (and L3) had
    hit_pages: dict[str, int] = field(default_factory=dict)  # pages used per fastest tier at match time
    released: bool = False
    gap: tuple[int, int] | None = None  # pages [k, s) the caller computes; None once committed
    # where the hit pages came from, by position: (first page, end page, tier) runs, for `ReadDeadlines.give_up_reads`
    hit_runs: list[tuple[int, int, str]] = field(default_factory=list)

    @property
    def base(self) -> TreeNode:
        """The root of the namespace the prefix is in (`node` itself where nothing is cached)."""
        node = self.node
        while not node.base:
            assert node.parent is not None
            node = node.parent
        return node

    @property
    def nodes(self) -> list[TreeNode]:
        """The used prefix, root excluded, in order."""
        path = []
        node = self.node
        while not node.base:
            path.append(node)
            assert node.parent is not None
            node = node.parent
        path.reverse()
        return path

    @property
    def num_pages(self) -> int:
        return sum(n.num_pages for n in self.nodes)

    def device_pages(self) -> list[int]:
        """GPU page ids of the used prefix, in order (no gap left: see prefix_pages)."""
        if self.gap is not None:
            raise ValueError(f"ticket has an uncommitted gap {self.gap}: use prefix_pages")
        return [p for n in self.nodes for p in n.device_pages]

    def part(self, start: int, end: int) -> list[TreeNode]:
        """The nodes of pages [start, end) of the prefix (start and end on node boundaries)."""
        out, pos = [], 0
        for node in self.nodes:
            if start <= pos < end:
                out.append(node)
            pos += node.num_pages
        return out

    @property
    def prefix_nodes(self) -> list[TreeNode]:
        """The nodes before the gap (all of them without one)."""
        return self.part(0, self.gap[0]) if self.gap is not None else self.nodes

    def prefix_pages(self) -> list[int]:
        """GPU page ids of pages [0, k)."""
        return [p for n in self.prefix_nodes for p in n.device_pages]

    @property
    def failed(self) -> bool:
        return any(self.transfers.failed(n) for n in self.nodes)

    def ready(self) -> bool:
        """True once every page of the prefix is on the GPU (or a load failed: see `failed`); gap nodes
        count as ready unless another request started loading them."""
        return all(self.transfers.ready(n) for n in self.nodes)

    def prefix_ready(self) -> bool:
        """True once pages [0, k) are on the GPU (the gap may be computed then)."""
        return all(self.transfers.ready(n) for n in self.prefix_nodes)

    def usable(self) -> bool:
        """True once a forward may read every page of the prefix: each is on the GPU, or its layered copy is
        launched and the forward waits for it layer by layer (`Transfers.usable`)."""
        return all(self.transfers.usable(n) for n in self.nodes)

    def prefix_usable(self) -> bool:
        """`usable` for pages [0, k)."""
        return all(self.transfers.usable(n) for n in self.prefix_nodes)
