"""L3 tier: a persistent NVMe page store (slab file + LMDB index). See docs/l3-format.md."""

from tiers.l3.format import FORMAT_VERSION, L3Error
from tiers.l3.store import L3Store

__all__ = ["FORMAT_VERSION", "L3Error", "L3Store"]
