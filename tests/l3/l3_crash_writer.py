"""Subprocess for the crash test: write pages forever, printing each key once write_pages returned True."""

from __future__ import annotations

import sys

from l3_helpers import NAMESPACE, content, key

from tiers.l3 import L3Store


def main(path: str, page_bytes: int, capacity_pages: int) -> None:
    store = L3Store(path, capacity_pages * page_bytes, page_bytes, NAMESPACE, sync_batch_pages=4)
    i = 0
    while True:
        keys = [key(i + j) for j in range(6)]
        for k, ok in zip(keys, store.write_pages(keys, [content(k, page_bytes) for k in keys])):
            if ok:
                sys.stdout.write(k.hex() + "\n")
        sys.stdout.flush()
        i += 6


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
