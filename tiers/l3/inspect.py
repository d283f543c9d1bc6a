"""`hicache l3 inspect`: describe (and optionally verify) an L3 store without modifying it."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import lmdb
import torch

from tiers.l3.format import NAMESPACE_BYTES, L3Error
from tiers.l3.index import INDEX_NAME, L3Index, index_map_bytes
from tiers.l3.slab import read_header, slab_path
from tiers.l3.store import L3Store

VERIFY_BATCH = 64


def _namespaces(directory: str) -> dict[str, int]:
    """Entry count per namespace (hex) found in the index."""
    try:
        index = L3Index(directory, index_map_bytes(0), read_only=True)
        try:
            counts = Counter(key[:NAMESPACE_BYTES].hex() for key, _ in index.items())
        finally:
            index.close()
    except lmdb.Error as e:
        raise L3Error(f"{os.path.join(directory, INDEX_NAME)}: index unreadable: {e}") from e
    return dict(counts)


def inspect_store(path: str | os.PathLike[str], verify: bool = False) -> dict[str, Any]:
    """Facts about the store at `path`; with verify, re-read every page and check its checksum.

    Opens read-only: no lock, LMDB readonly without its lock file, access times untouched.
    Raises L3Error if there is no readable store at `path`.
    """
    directory = os.path.abspath(os.fspath(path))
    file = slab_path(directory)
    try:
        header = read_header(file)
    except (OSError, ValueError) as e:
        raise L3Error(f"{file}: cannot read slab header: {e}") from e
    report = {
        "path": directory, "format_version": header.version, "namespace": header.namespace.hex(),
        "namespaces": _namespaces(directory), "page_bytes": header.page_bytes,
        "slot_bytes": header.slot_bytes, "slab_file_bytes": os.path.getsize(file),
        "index_file_bytes": os.path.getsize(os.path.join(directory, INDEX_NAME)),
    }
    with L3Store(directory, header.slot_count * header.slot_bytes, header.page_bytes, header.namespace,
                 read_only=True) as store:
        stats = store.stats()
        report.update(pages=stats["pages"], bytes=stats["bytes"], capacity_pages=stats["capacity_pages"],
                      capacity_bytes=stats["capacity_bytes"], io_backend=stats["io_backend"],
                      dropped_entries=stats["dropped_entries"])
        if verify:
            good = bad = 0
            keys = store.keys()
            buffers = [torch.empty(header.page_bytes, dtype=torch.uint8) for _ in range(VERIFY_BATCH)]
            # keys [start, start + VERIFY_BATCH) per read batch
            for start in range(0, len(keys), VERIFY_BATCH):
                batch = keys[start:start + VERIFY_BATCH]
                ok = store.read_pages(batch, buffers[:len(batch)])
                good += sum(ok)
                bad += len(ok) - sum(ok)
            report["verify"] = {"good": good, "bad": bad}
    return report


def format_report(report: dict[str, Any]) -> str:
    """Human-readable lines for an inspect_store() result."""
    mib = 1 << 20
    namespaces = report["namespaces"]
    lines = [
        f"L3 store        {report['path']}",
        f"format version  {report['format_version']}",
        f"page bytes      {report['page_bytes']} (slot {report['slot_bytes']})",
        f"pages           {report['pages']} / {report['capacity_pages']} "
        f"({report['bytes'] / mib:.1f} / {report['capacity_bytes'] / mib:.1f} MiB)",
        f"io backend      {report['io_backend']}",
        f"slab namespace  {report['namespace']}",
        "namespaces      " + (", ".join(f"{ns} ({n} pages)" for ns, n in namespaces.items()) or "none"),
    ]
    if report.get("dropped_entries"):
        lines.append(f"invalid entries {report['dropped_entries']} (outside the slab or malformed)")
    if "verify" in report:
        lines.append(f"verify          {report['verify']['good']} good, {report['verify']['bad']} bad")
    return "\n".join(lines)
