"""When one tier's pages are copied to the tier below: the write-policy strategies the write mechanism
(controller/writes.py) runs under, one per tier boundary (GPU -> host, host -> L3).

A strategy answers three events for a node: it was just committed, it was hit, it is about to be evicted. Each
answer is whether to copy the node down now. `tier_writes` picks the strategy for a `WritePolicy` mode.
"""

from __future__ import annotations

from controller.policy import WritePolicy
from radix import TreeNode


class TierWrites:
    """When one tier's pages are copied to the tier below (see the module doc). The base copies never."""

    defers = False  # commit-time copies may wait for memory pressure (DeferredWriteThrough)
    defer_above_free = 1.0  # while more than this share of the GPU pool is free, they wait (see DeferredWriteThrough)
    counts_hits = False  # a hit is reported to the L3's admission rule before the copy is retried

    def on_commit(self, node: TreeNode) -> bool:
        return False

    def on_hit(self, node: TreeNode) -> bool:
        return False

    def on_evict(self, node: TreeNode) -> bool:
        return False


class NoWrites(TierWrites):
    """The tier below is absent."""


class WriteThrough(TierWrites):
    counts_hits = True

    def on_commit(self, node: TreeNode) -> bool:
        return True

    def on_hit(self, node: TreeNode) -> bool:
        return True  # the copy made at commit was refused (full tier or queue), or evicted below: again


class DeferredWriteThrough(WriteThrough):
    defers = True

    def __init__(self, defer_above_free: float):
        self.defer_above_free = defer_above_free

    def on_evict(self, node: TreeNode) -> bool:
        return True  # its queued copy had not started yet


class SelectiveWriteThrough(TierWrites):

    def __init__(self, hits: int):
        self.hits = hits

    def on_hit(self, node: TreeNode) -> bool:
        return node.hit_count >= self.hits


class WriteBack(TierWrites):

    def on_evict(self, node: TreeNode) -> bool:
        return True


def tier_writes(mode: str, policy: WritePolicy, deferrable: bool = False) -> TierWrites:
    """The strategy for one tier's `mode` (a name of `controller.policy.WRITE_POLICIES`)."""
    if mode == "write_back":
        return WriteBack()
    if mode == "write_through_selective":
        return SelectiveWriteThrough(policy.selective_hits)
    if deferrable and policy.defers_backups:
        return DeferredWriteThrough(policy.defer_above_free)
    return WriteThrough()
