"""What a store's pages are for, in words: the settings its namespace fingerprints, kept beside the slab.

The slab header holds only the namespace's 16-byte fingerprint (radix.hashing). A server opening the store with
other settings (another model, dtype, page size, layout or rank) gets a different fingerprint, and two hex
strings tell its operator nothing; `namespace.json` lets the error name the settings that differ.
"""

from __future__ import annotations

import json
import os
from typing import Any

FIELDS_NAME = "namespace.json"


def write_namespace_fields(directory: str, fields: dict[str, Any]) -> None:
    """Record the settings a new store's namespace fingerprints (written once, when its slab is created)."""
    path = os.path.join(directory, FIELDS_NAME)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(fields, f, sort_keys=True, indent=1, default=str)
        f.write("\n")
    os.replace(tmp, path)


def namespace_difference(directory: str, fields: dict[str, Any]) -> str:
    """Which of `fields` differ from those the store in `directory` was created with, as a phrase."""
    try:
        with open(os.path.join(directory, FIELDS_NAME), encoding="utf-8") as f:
            stored = json.load(f)
    except (OSError, ValueError):
        return "it was created with other model or cache settings (it records no more: " \
               f"{FIELDS_NAME} is missing or unreadable)"
    if not isinstance(stored, dict):
        return f"it was created with other model or cache settings ({FIELDS_NAME} is not a mapping)"
    current = json.loads(json.dumps(fields, default=str))  # the same normal form as the file's
    differ = [f"{key} {stored.get(key, '(unset)')!r} there, {current.get(key, '(unset)')!r} here"
              for key in sorted(set(stored) | set(current)) if stored.get(key) != current.get(key)]
    if not differ:
        return "it was created by a hicache whose namespace fingerprint differs for the same settings"
    return "; ".join(differ)


def allocated_slots(slab: str, slot_bytes: int) -> int:
    """About how many slots of a (sparse) slab file have been written: its allocated blocks by slot size."""
    try:
        return os.stat(slab).st_blocks * 512 // slot_bytes
    except OSError:
        return 0
