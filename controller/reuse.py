"""Which new pages are likely to be read again: the L3 write rule `cache.write_policy.l3_admit: reuse`.

Whether loading a page from the disk beats recomputing it for one request alone is the wrong test for a write:
under load the GPU is the bottleneck, requests queue, and a page the disk delivers while its request waits is
a page the GPU does not compute (prefetch, deadlines: controller/loads.py). What a write needs is a reader. A
page is likely to have one when
- it was hit: a prefix served once is served again (system prompts, documents);
- it continues a prefix that was hit: the growing context of a multi-turn conversation or an agent session,
  whose next turn reads this turn's pages;
- it is computed a second time: its key was computed before and evicted (Dynamo's KV block manager writes to
  disk at frequency two, counting blocks that left memory too).
Other pages are written only with bandwidth to spare, and only while the traffic reuses. The first turn of an agent
session looks like a one-off prompt until its second turn arrives, by when a small host tier has long evicted it:
writing it while the disk's write queue has room is what lets the second turn load instead of recompute. Such a
write takes spare room in the queue or none: refused, it is remembered without a pin and written once room comes
back (newest first), so it never delays a likely page's write (controller/writes.py). Whether the traffic reuses is
the decayed share of requests whose prompt started with a cached prefix: traffic without reuse (one-off requests,
the no-reuse case) drives it under TRAFFIC_REUSE_MIN within 44 requests, and its pages are then not written, so it
costs the disk nothing; nor are those whose host copy was deferred copied on their way out of the GPU, a copy the
engine would wait for (controller/backups.py, `_copies_on_leaving_gpu`). Under TRAFFIC_ONE_OFF_MAX, within 95
requests, new pages get no host copy at all (`one_off`, `HostBackups.deferring`). How fast the writes that pass go
is the write queue's business: bounded (`cache.l3.queue_pages`, `write_policy.l3_host_share`) and behind reads on
the I/O threads.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from radix import TreeNode

ADMIT_MODES = ("reuse", "all")
TRAFFIC_REUSE_WEIGHT = 1 / 32  # each request's weight in the traffic's decayed reuse share (older ones fade)
TRAFFIC_REUSE_MIN = 0.25  # below this share of requests with a cached prefix, pages without a reader are not written
# below this share the traffic is one-off prompts: new pages get no host copy (controller/backups.py, `deferring`)
TRAFFIC_ONE_OFF_MAX = 0.05


def reuse_memory(host_pages: int, disk_pages: int) -> int:
    """How many page keys the filter remembers: a few times what host and disk hold (a page evicted from both and
    computed again still counts as seen), within [4,096, 1,048,576] (about 100 bytes a key)."""
    return min(1 << 20, max(4096, 4 * (host_pages + disk_pages)))


class ReuseFilter:
    """Remembers how often page keys were computed, and whether they continued a hit, for the last `capacity`
    keys (oldest forgotten first). `likely(node)`: whether writing the node to the L3 is expected to pay."""

    def __init__(self, mode: str = "reuse", capacity: int = 1 << 18):
        if mode not in ADMIT_MODES:
            raise ValueError(f"l3_admit={mode!r}; choices: {list(ADMIT_MODES)}")
        self.mode = mode
        self.capacity = max(1, capacity)
        self._uses: OrderedDict[bytes, int] = OrderedDict()  # page key -> uses seen (2: reuse expected)
        # decayed share of requests whose prompt started with a cached prefix; a cache's traffic is assumed to reuse
        # until it shows otherwise (a session's first turn comes before any hit)
        self.traffic_reuse = 1.0

    def computed(self, nodes: Sequence[TreeNode], continues_hit: bool) -> None:
        """These nodes' pages were just computed, by a request whose prompt started with a cached prefix
        (`continues_hit`) or not."""
        if self.mode == "all":
            return
        uses = self._uses
        for node in nodes:
            for key in node.keys:
                seen = uses.pop(key, 0)
                uses[key] = 2 if continues_hit else seen + 1
        while len(uses) > self.capacity:
            uses.popitem(last=False)

    def requested(self, cached_prefix: bool) -> None:
        """A request arrived whose prompt matched a cached prefix (`cached_prefix`) or none."""
        self.traffic_reuse += TRAFFIC_REUSE_WEIGHT * (cached_prefix - self.traffic_reuse)

    def traffic_reuses(self) -> bool:
        """Whether the traffic lately reuses prefixes: pages without a reader of their own may take spare write
        bandwidth."""
        return self.mode == "all" or self.traffic_reuse >= TRAFFIC_REUSE_MIN

    def one_off(self) -> bool:
        """Whether the traffic is one-off prompts: almost no request lately started with a cached prefix. A trace with
        partial reuse (the Mooncake sample) spends long stretches under TRAFFIC_REUSE_MIN whose pages are read much
        later: host copies stop only under this much lower share, which one-off traffic reaches within 100 requests."""
        return self.mode != "all" and self.traffic_reuse < TRAFFIC_ONE_OFF_MAX

    def likely(self, node: TreeNode) -> bool:
        if self.mode == "all" or node.hit_count > 0:
            return True
        return self._uses.get(node.keys[0], 0) >= 2
