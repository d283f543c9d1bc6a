"""L3 tier: a persistent NVMe page store (slab file + LMDB index). See docs/l3-format.md.

`L3Store` (torch, lmdb) loads on first use, so that the admission rule and the format are importable without them.
"""

from __future__ import annotations

from typing import Any

from tiers.l3.format import FORMAT_VERSION, L3Error


def __getattr__(name: str) -> Any:
    if name == "L3Store":
        from tiers.l3.store import L3Store

        return L3Store
    raise AttributeError(f"module 'tiers.l3' has no attribute {name!r}")


__all__ = ["FORMAT_VERSION", "L3Error", "L3Store"]
