"""Chained content hashes of pages: the L3 key of a page.

key(page i) = blake2b-128(key(page i-1) || token ids of page i), seeded with a namespace that
fingerprints everything that changes the KV bytes (model, revision, dtype, layout, page size,
KV heads, head dim, layers, TP rank). Equal keys mean equal tokens, equal prefix and equal bytes.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence

KEY_BYTES = 16


def namespace_fingerprint(fields: Mapping[str, object]) -> bytes:
    """A 16-byte fingerprint of `fields` (order-independent); used as the root of every page chain."""
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(canonical.encode(), digest_size=KEY_BYTES, person=b"hicache-ns").digest()


def page_keys(parent_key: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Chained keys of the full pages of `tokens`, continuing the chain from `parent_key`."""
    keys = []
    prev = parent_key
    step = page_size * 8  # bytes of a page's int64 token ids
    # the full pages' ids converted in one call: per page, the conversion cost about as much as the hash
    data = array("q", tokens[: len(tokens) // page_size * page_size]).tobytes()
    blake2b = hashlib.blake2b
    for start in range(0, len(data), step):
        prev = blake2b(prev + data[start : start + step], digest_size=KEY_BYTES).digest()
        keys.append(prev)
    return keys
