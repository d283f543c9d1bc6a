"""Do /metrics scrapers slow the requests being served?

Starts `hicache serve` (the tests' small config with --model, default SmolLM2-135M), times a 20-token completion
alone, then with `--scrapers` threads scraping /metrics back to back meanwhile; prints both times and their ratio,
median of `--repeats`.

Usage: .venv/bin/python bench/metrics_scrape_load.py [--model random:tiny] [--scrapers 8] [--repeats 3] [--path /health]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from server_helpers import ServerProcess, tiny_config  # noqa: E402


def timed_request(url: str) -> float:
    start = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "Tell me about caches.", "max_tokens": 20,
                                                    "ignore_eos": True}, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--scrapers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--path", default="/metrics", help="what the scrapers ask for (/health: the cheapest answer)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--config", str(tiny_config(Path(tmp), **{"model.name": args.model}))],
                               Path(tmp) / "server.log").wait_ready(300)
        try:
            timed_request(server.url)  # warm-up
            alone = statistics.median(timed_request(server.url) for _ in range(args.repeats))
            stop = threading.Event()
            scrapes = [0]

            def scrape() -> None:
                with httpx.Client(timeout=60) as client:
                    while not stop.is_set():
                        client.get(f"{server.url}{args.path}")
                        scrapes[0] += 1

            threads = [threading.Thread(target=scrape) for _ in range(args.scrapers)]
            for t in threads:
                t.start()
            try:
                busy = statistics.median(timed_request(server.url) for _ in range(args.repeats))
            finally:
                stop.set()
                for t in threads:
                    t.join()
        finally:
            server.stop()
    print(f"20-token request alone {alone:.3f} s; beside {args.scrapers} scrapers of {args.path} {busy:.3f} s "
          f"({busy / alone:.2f}x, {scrapes[0]} scrapes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
