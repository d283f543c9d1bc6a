"""hicache's disk and shared tiers as an SGLang HiCache storage backend, loaded at run time with no change to SGLang:

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
        '{"backend_name": "hicache", "module_path": "hicache.integrations.sglang", "class_name": "HicacheStorage",
          "interface_v1": 1, "path": "/nvme/hicache", "size_gib": 512}'

SGLang's cache controller calls a backend from its prefetch and backup threads, one batch of page hashes at a time:
`batch_exists` counts the leading pages it holds, `batch_get`/`batch_set` move flat pages, and with `interface_v1`
`batch_get_v1`/`batch_set_v1` move pages between the store and the host pool in place.

A page is stored as one record per K and V half (one for MLA, whose page has no halves): a half is contiguous in
the host pool's page-first layouts, so the v1 calls read and write the pool's memory directly, and the flat pages
of the generic calls hold the same halves back to back. The store's identity comes from `HiCacheStorageConfig`
and the host pool: the model, its dtype and page shape, the pool's layout (a page's bytes are in its order), and
the parallel rank. The other keys of the extra config are `TierOptions`' (docs/integrations.md).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from hicache.config import ConfigError
from hicache.integrations.chunks import ChunkStore, WaitedJobs, chunk_key
from hicache.integrations.options import TierOptions

logger = logging.getLogger(__name__)

# extra-config keys that SGLang reads itself; the rest are the tier's options (an unknown one is an error)
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size",
                         "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
                         "hicache_storage_pass_prefix_keys"})
# layouts whose page halves are contiguous in the host pool's buffer (the v1 calls move them in place)
IN_PLACE_LAYOUTS = ("page_first", "page_first_direct", "page_head")
SOURCE = "--hicache-storage-backend-extra-config"
UNREGISTERED = ("HicacheStorage: SGLang registers its host pool before the first call (register_mem_pool_host); "
                "without it the page layout is unknown")


class HicacheStorage(HiCacheStorage):
    """hicache's L3 store (and shared tier) as an SGLang storage backend; see the module doc. The store opens
    when SGLang registers its host pool, whose layout and page shape are part of the store's identity."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.config = storage_config
        extra = dict(storage_config.extra_config or {})
        self.options = TierOptions.parse({k: v for k, v in extra.items() if k not in SGLANG_KEYS}, SOURCE)
        self.mla = bool(storage_config.is_mla_model)
        if self.mla and storage_config.tp_size > 1 and self.options.path is not None:
            # SGLang backs MLA pages up from one rank only, and a local store has one writer: the other ranks
            # would never find a page. A shared tier is the store every rank reads.
            raise ConfigError(f"{SOURCE}: an MLA model over {storage_config.tp_size} ranks needs the shared tier "
                              "only (`remote`, no `path`): SGLang writes its pages from rank 0 alone")
        self.parts = 1 if self.mla else 2
        self.chunks: ChunkStore | None = None
        self.mem_pool_host: Any = None
        self._jobs: WaitedJobs | None = None

    # ---- setup

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        self.mem_pool_host = mem_pool_host
        page = mem_pool_host.get_dummy_flat_data_page()
        page_bytes = page.numel() * page.element_size()
        if page_bytes % self.parts:
            raise ConfigError(f"{SOURCE}: a host page of {page_bytes} bytes does not split into K and V halves")
        self.close()
        self.chunks = ChunkStore(self.options, page_bytes // self.parts, self._identity(mem_pool_host, page),
                                 self._part(), SOURCE)
        self._jobs = WaitedJobs(self.chunks.store, queue_pages=self.options.queue_chunks,
                                batch_pages=self.chunks.sync_batch_chunks)

    def _identity(self, pool: Any, page: torch.Tensor) -> dict[str, Any]:
        c = self.config
        fields: dict[str, Any] = {
            "engine": "sglang", "model": c.model_name, "host_pool": type(pool).__name__,
            "layout": pool.layout, "dtype": str(page.dtype), "page_size": pool.page_size,
            "page_elements": page.numel(), "mla": self.mla,
            "pp": [c.pp_rank, c.pp_size], "attn_cp": [c.attn_cp_rank, c.attn_cp_size],
        }
        if not self.mla:  # every rank holds its own heads; MLA ranks hold the same bytes
            fields["tp"] = [c.tp_rank, c.tp_size]
        if getattr(c, "dcp_size", 1) > 1:
            fields["dcp"] = [c.dcp_rank, c.dcp_size, c.logical_page_size]
        return fields

    def _part(self) -> str | None:
        """The directory of this rank's store under `path`: one per (pipeline stage, TP rank, context rank)."""
        c = self.config
        parts = []
        if c.pp_size > 1:
            parts.append(f"pp{c.pp_size}-{c.pp_rank}")
        if c.tp_size > 1:
            parts.append(f"tp{c.tp_size}-rank{c.tp_rank}")
        if c.attn_cp_size > 1:
            parts.append(f"cp{c.attn_cp_size}-{c.attn_cp_rank}")
        if getattr(c, "dp_rank", 0):
            parts.append(f"dp{c.dp_rank}")
        return "-".join(parts) or None

    @property
    def _waited(self) -> WaitedJobs:
        if self._jobs is None:
            raise RuntimeError(UNREGISTERED)
        return self._jobs

    @property
    def _store(self) -> ChunkStore:
        if self.chunks is None:
            raise RuntimeError(UNREGISTERED)
        return self.chunks

    # ---- keys

    def _keys(self, key: str, extra_info: HiCacheStorageExtraInfo | None = None) -> list[bytes]:
        salt = None
        if extra_info is not None and extra_info.extra_info:
            salt = extra_info.extra_info.get("cache_salt") or extra_info.extra_info.get("salt")
        base = key.encode()
        if self.parts == 1:
            return [chunk_key(base, salt)]
        return [chunk_key(base + b"|k", salt), chunk_key(base + b"|v", salt)]

    def _halves(self, flat: torch.Tensor) -> list[torch.Tensor]:
        raw = flat.reshape(-1).view(torch.uint8)
        size = self._store.chunk_bytes
        if raw.numel() != size * self.parts:
            return [raw]  # not a page of this pool: refused whole (`_sound`)
        return [raw[i * size:(i + 1) * size] for i in range(self.parts)]

    # ---- the generic calls: flat pages

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        store = self._store
        flat = [k for key in keys for k in self._keys(key, extra_info)]
        found = store.contains_local(flat)
        if store.remote is not None and not all(found):
            missing = [i for i, hit in enumerate(found) if not hit]
            for i, hit in zip(missing, store.remote.contains([flat[i] for i in missing])):
                found[i] = hit
        for n in range(len(keys)):
            if not all(found[n * self.parts:(n + 1) * self.parts]):
                return n
        return len(keys)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        targets = [t if t is not None else self.mem_pool_host.get_dummy_flat_data_page() for t in targets]
        return self._read(keys, targets, None)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return all(self._write(keys, list(values), None))

    # ---- the zero-copy calls: pages of the host pool, in place where the layout allows

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        starts = self._page_starts(keys, host_indices)
        if self._in_place():
            pages = [self._pool_halves(s) for s in starts]
            return [got is not None for got in self._read(keys, pages, extra_info, split=False)]
        flats = [pool.get_dummy_flat_data_page() for _ in keys]
        results = []
        for start, got in zip(starts, self._read(keys, flats, extra_info)):
            if got is not None:
                pool.set_from_flat_data_page(start, got)
            results.append(got is not None)
        return results

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        starts = self._page_starts(keys, host_indices)
        if self._in_place():
            return self._write(keys, [self._pool_halves(s) for s in starts], extra_info, split=False)
        return self._write(keys, [pool.get_data_page(s, flat=True) for s in starts], extra_info)

    def _page_starts(self, keys: list[str], host_indices: torch.Tensor) -> list[int]:
        page = self.mem_pool_host.page_size
        if host_indices.numel() != len(keys) * page:
            raise ValueError(f"HicacheStorage: {len(keys)} keys need {len(keys) * page} host indices, "
                             f"got {host_indices.numel()}")
        return [int(i) for i in host_indices[::page].tolist()]

    def _in_place(self) -> bool:
        pool = self.mem_pool_host
        return not self.mla and pool.layout in IN_PLACE_LAYOUTS and pool.kv_buffer.device.type == "cpu"

    def _pool_halves(self, start: int) -> list[torch.Tensor]:
        """The K and V halves of the host page at token slot `start`, as byte views of the pool's buffer."""
        pool = self.mem_pool_host
        kv = pool.kv_buffer
        index: Any = slice(start, start + pool.page_size) if pool.layout == "page_first" else start // pool.page_size
        return [kv[j, index].reshape(-1).view(torch.uint8) for j in range(2)]

    # ---- I/O

    def _read(self, keys: list[str], targets: list[Any], extra_info: HiCacheStorageExtraInfo | None,
              split: bool = True) -> list[Any]:
        """Read each page into its target (a flat page, or its halves with split=False); a page is returned only
        if every half verified, else None (a miss: SGLang stops its prefetch there)."""
        sound = self._sound(keys, [self._halves(t) if split else t for t in targets], "get")
        flat_keys = [k for i, key in enumerate(keys) if i in sound for k in self._keys(key, extra_info)]
        ok = iter(self._waited.read(flat_keys, [half for i in sorted(sound) for half in sound[i]]))
        got = {i: all([next(ok) for _ in range(self.parts)]) for i in sorted(sound)}
        return [t if got.get(i, False) else None for i, t in enumerate(targets)]

    def _write(self, keys: list[str], pages: list[Any], extra_info: HiCacheStorageExtraInfo | None,
               split: bool = True) -> list[bool]:
        sound = self._sound(keys, [self._halves(p) if split else p for p in pages], "set")
        flat_keys = [k for i, key in enumerate(keys) if i in sound for k in self._keys(key, extra_info)]
        ok = iter(self._waited.write(flat_keys, [half for i in sorted(sound) for half in sound[i]]))
        stored = {i: all([next(ok) for _ in range(self.parts)]) for i in sorted(sound)}
        return [stored.get(i, False) for i in range(len(keys))]

    def _sound(self, keys: list[str], halves: list[list[torch.Tensor]], call: str) -> dict[int, list[torch.Tensor]]:
        """The pages whose halves are each a whole chunk, by index. A page of another size fails alone, logged
        with its key: in a batch it would make the store refuse the whole batch, other callers' pages with it."""
        size = self._store.chunk_bytes
        sound = {}
        for i, parts in enumerate(halves):
            if len(parts) == self.parts and all(h.numel() * h.element_size() == size for h in parts):
                sound[i] = parts
            else:
                got = sum(h.numel() * h.element_size() for h in parts)
                logger.error("HicacheStorage.%s: page %r is %d bytes, expected %d: not %s", call, keys[i], got,
                             size * self.parts, "stored" if call == "set" else "read")
        return sound

    # ---- the rest of the backend API

    def clear(self) -> None:
        """Drop every page of the local store (the shared tier's copies stay for the other servers)."""
        store = self._store
        if store.local is not None:
            store.local.delete(store.local.keys())

    def stats(self) -> dict[str, Any]:
        """The store's counters (`L3Store.stats`; SGLang's own `get_stats` reports its controller's timings)."""
        return self._store.store.stats()

    def close(self) -> None:
        if self._jobs is not None:
            self._jobs.close()
            self._jobs = None
        if self.chunks is not None:
            self.chunks.close()
            self.chunks = None
