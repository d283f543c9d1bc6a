"""Does /health stay fast while the server refuses prompts too big for its context?

Starts `hicache serve` (random:tiny unless --model; small tiers; the tests' config), sends 1 and then 4 prompts of
3.9 MB of text at once (`--ids`: of 2,000,000 one-digit token ids, a 4 MB body), and polls /health meanwhile.
Prints each request's status and time, and the slowest
/health answer; exit 1 if that took longer than --limit seconds (a liveness probe's budget).

Usage: .venv/bin/python bench/big_prompt_health.py [--model smollm2-135m-instruct] [--limit 0.5] [--ids]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "server"))
from server_helpers import ServerProcess, tiny_config  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--limit", type=float, default=0.5, help="seconds /health may take")
    ap.add_argument("--ids", action="store_true", help="prompts of 2,000,000 token ids instead of text")
    args = ap.parse_args()
    prompt: str | list[int] = [i % 10 for i in range(2_000_000)] if args.ids else ("word " * 800_000)[:3_900_000]
    body = json.dumps({"prompt": prompt, "max_tokens": 1}, separators=(",", ":"))
    what = "2,000,000 token ids" if args.ids else "3.9 MB"
    worst_all = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProcess(["--config", str(tiny_config(Path(tmp), **{"model.name": args.model}))],
                               Path(tmp) / "server.log").wait_ready(300)
        try:
            for n in (1, 4):
                results: list[tuple[int, float]] = []

                def big(results: list[tuple[int, float]] = results) -> None:
                    start = time.perf_counter()
                    r = httpx.post(f"{server.url}/v1/completions", content=body,
                                   headers={"Content-Type": "application/json"}, timeout=120)
                    results.append((r.status_code, round(time.perf_counter() - start, 2)))

                threads = [threading.Thread(target=big) for _ in range(n)]
                for t in threads:
                    t.start()
                worst = 0.0
                while any(t.is_alive() for t in threads):
                    start = time.perf_counter()
                    httpx.get(f"{server.url}/health", timeout=30)
                    worst = max(worst, time.perf_counter() - start)
                    time.sleep(0.05)
                worst_all = max(worst_all, worst)
                print(f"{n} prompt(s) of {what}: {results}; slowest /health {worst:.3f} s")
        finally:
            server.stop()
    ok = worst_all <= args.limit
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
