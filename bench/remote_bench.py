"""Remote tier throughput: the store's writes and reads against a raw client loop on the same server, same run.

    .venv/bin/python bench/remote_bench.py [--url redis://127.0.0.1:6379/0] [--mib 512] [--repeat 3]
    .venv/bin/python bench/remote_bench.py --mooncake [--mib 512] [--repeat 3]   # the mooncake extra

Without --url a local valkey-server is started (hicache.valkey_local), or with --mooncake a local mooncake_master
(hicache.mooncake_local). For each page size (8 MiB: a 64-token page of an 8B model; 180 KiB: a 16-token page of
a small one) the store writes then reads `--mib` MiB of pages in its batches, headers and checksums included, into
and out of page-aligned host memory; the raw loop moves the same bytes in batches of the same size with no header,
checksum or bookkeeping, which is what the server and the loopback allow. Valkey's raw loop: SET from the buffer
with sendmsg, GET with recv_into. Mooncake's: batch_put_from / batch_get_into on registered memory. Best of
--repeat.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hicache.valkey_local import LocalServer  # noqa: E402
from tiers.persistent import remote_name, remote_store_class  # noqa: E402
from tiers.remote.valkey import ValkeyAddress as ValkeyAddress  # noqa: E402
from tiers.remote.valkey import _Connection

SIZES = {"8 MiB": 8 << 20, "180 KiB": 180 << 10}


def pages_of(count: int, size: int) -> list[torch.Tensor]:
    flat = torch.frombuffer(mmap.mmap(-1, count * size), dtype=torch.uint8)
    flat.copy_(torch.randint(0, 256, (count * size,), dtype=torch.uint8))
    return list(flat.view(count, size))


def raw_loop(address: ValkeyAddress, pages: list[torch.Tensor], batch: int) -> tuple[float, float]:
    """Seconds to SET then GET every page with plain pipelined commands."""
    conn = _Connection(address, 2.0, 30.0)
    keys = [b"raw:%d" % i for i in range(len(pages))]
    start = time.perf_counter()
    for b in range(0, len(pages), batch):
        parts = []
        for i in range(b, min(len(pages), b + batch)):
            parts += _Connection.command(b"SET", keys[i], memoryview(pages[i].numpy()))
        conn.send(parts)
        for _ in range(b, min(len(pages), b + batch)):
            assert conn.reply() == "OK"
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for b in range(0, len(pages), batch):
        conn.send([p for i in range(b, min(len(pages), b + batch)) for p in _Connection.command(b"GET", keys[i])])
        for i in range(b, min(len(pages), b + batch)):
            line = conn._line()
            assert int(line[1:]) == pages[i].numel()
            conn._into(memoryview(pages[i].numpy()))
            conn._skip(2)
    read_s = time.perf_counter() - start
    conn.send([p for k in keys for p in _Connection.command(b"DEL", k)])
    for _ in keys:
        conn.reply()
    conn.close()
    return write_s, read_s


def mooncake_raw_loop(url: str, pages: list[torch.Tensor], batch: int) -> tuple[float, float]:
    """Seconds to put then get every page with Mooncake's own batch calls on registered memory."""
    from mooncake.store import MooncakeDistributedStore

    from tiers.remote.mooncake import MooncakeAddress

    a = MooncakeAddress.parse(url)
    client = MooncakeDistributedStore()
    assert client.setup(a.local, a.metadata, a.segment_bytes, a.buffer_bytes, a.protocol, a.device, a.master) == 0
    size = pages[0].numel()
    assert client.register_buffer(pages[0].data_ptr(), len(pages) * size) == 0  # one mapping (pages_of)
    keys = [f"raw:{i}" for i in range(len(pages))]
    warm = [f"raw-warm:{i}" for i in range(len(pages))]  # the first pass, on other keys, as the store's
    for b in range(0, len(pages), batch):
        part = range(b, min(len(pages), b + batch))
        client.batch_put_from([warm[i] for i in part], [pages[i].data_ptr() for i in part], [size] * len(part))
        client.batch_get_into([warm[i] for i in part], [pages[i].data_ptr() for i in part], [size] * len(part))
    client.batch_remove(warm, True)
    start = time.perf_counter()
    for b in range(0, len(pages), batch):
        part = range(b, min(len(pages), b + batch))
        assert client.batch_put_from([keys[i] for i in part], [pages[i].data_ptr() for i in part],
                                     [size] * len(part)) == [0] * len(part)
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    for b in range(0, len(pages), batch):
        part = range(b, min(len(pages), b + batch))
        assert client.batch_get_into([keys[i] for i in part], [pages[i].data_ptr() for i in part],
                                     [size] * len(part)) == [size] * len(part)
    read_s = time.perf_counter() - start
    client.batch_remove(keys, True)
    client.close()
    return write_s, read_s


def store_loop(url: str, pages: list[torch.Tensor], size: int) -> tuple[float, float, int]:
    store = remote_store_class(url)(url, b"remote-bench-ns1", size, key_prefix="bench", timeout_s=30.0)
    keys = [i.to_bytes(16, "little") for i in range(len(pages))]
    warm = [(i + len(pages)).to_bytes(16, "little") for i in range(len(pages))]
    # a first pass on other keys: connections, registrations and buffers, as a server has them after its start
    # (timing the same keys again would time Mooncake's answer to a key it already has)
    assert all(store.write_pages(warm, pages)) and all(store.read_pages(warm, pages))
    store.delete(warm)
    start = time.perf_counter()
    assert all(store.write_pages(keys, pages))
    write_s = time.perf_counter() - start
    start = time.perf_counter()
    assert all(store.read_pages(keys, pages))
    read_s = time.perf_counter() - start
    store.delete(keys)
    batch = store.batch_pages
    store.close()
    return write_s, read_s, batch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start a local valkey-server)")
    p.add_argument("--mooncake", action="store_true", help="start a local mooncake_master and measure that")
    p.add_argument("--mib", type=int, default=512, help="bytes moved per pass")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    server = None
    if args.mooncake:
        from hicache.mooncake_local import LocalMaster

        server = LocalMaster().start()
        url = server.url(segment_mib=4 * args.mib + 256, buffer_mib=64)
    elif args.url is None:
        server = LocalServer(maxmemory=f"{2 * args.mib + 256}mb").start()
        url = server.url
    else:
        url = args.url
    raw = (mooncake_raw_loop if url.startswith("mooncake://")
           else lambda u, pages, batch: raw_loop(ValkeyAddress.parse(u), pages, batch))
    try:
        print(f"server {remote_name(url)}, {args.mib} MiB a pass, best of {args.repeat}")
        print("| page | store write | raw write | ratio | store read | raw read | ratio |")
        print("|---|---|---|---|---|---|---|")
        for name, size in SIZES.items():
            pages = pages_of(max(1, (args.mib << 20) // size), size)
            nbytes = len(pages) * size
            best = {"sw": 1e9, "sr": 1e9, "rw": 1e9, "rr": 1e9}
            for _ in range(args.repeat):
                sw, sr, batch = store_loop(url, pages, size)
                rw, rr = raw(url, pages, batch)
                best = {"sw": min(best["sw"], sw), "sr": min(best["sr"], sr), "rw": min(best["rw"], rw),
                        "rr": min(best["rr"], rr)}
            gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
            print(f"| {name} ({len(pages)} pages, {batch} a batch) | {gbs['sw']:.2f} GB/s | {gbs['rw']:.2f} GB/s | "
                  f"{gbs['sw'] / gbs['rw']:.2f} | {gbs['sr']:.2f} GB/s | {gbs['rr']:.2f} GB/s | "
                  f"{gbs['sr'] / gbs['rr']:.2f} |")
    finally:
        if server is not None:
            server.stop() if args.mooncake else server.close()


if __name__ == "__main__":
    main()
