"""The replay's time model against the server: predicted and measured duration and mean TTFT, arm by arm.

    python bench/replay_vs_server.py OUT_DIR [--config CONFIG] [--workload DIR] [--json OUT.json]

OUT_DIR holds what bench/cpu_agent.sh or `bench/gpu/run.sh agent` leave per arm: the client's ARM.json (`hicache
bench agent --json`), the server's log ARM.server.log and its /metrics at the end, ARM.metrics.txt. For each arm
the replay runs the same agent sessions (OUT_DIR/workload, or --workload) with the server's own figures: the tier
sizes and page bytes its log states, the costs its /metrics exported (`--calibration`: prefill speed, attention per
token pair, host and disk bandwidths, the decode-step fit), the `--set`s and load flags it was started with
(NAME.flags.txt: L3 caps, policies), and the scheduler settings of CONFIG (the server's config file). Arms with a
remote tier are skipped: the replay does not model it. It prints predicted against measured and the ratio; a
prediction within 15% of the measurement is what bench/RESULTS.md, 'Replay predicts time', asks of it. An arm
whose client saw failed requests is marked: it measured a different workload.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

CACHE_LINE = re.compile(r"cache: page (\d+) tokens x (\d+) bytes; "
                        r"device (\d+) pages, host (\d+) pages, disk (\d+) pages")


def server_setup(log: Path) -> dict[str, int]:
    """Tier sizes (tokens) and KV bytes per token, from a server log."""
    text = log.read_text(errors="replace")
    m = CACHE_LINE.search(text)
    if m is None:
        raise SystemExit(f"{log}: no 'cache: page ...' line (not a hicache server log?)")
    page, page_bytes, device, host, disk = map(int, m.groups())
    return {"device_tokens": device * page, "host_tokens": host * page,
            "disk_tokens": disk * page, "kv_bytes_per_token": page_bytes // page}


def serve_flags(path: Path) -> list[str]:
    """The replay flags that say what the arm's `hicache serve` flags (NAME.flags.txt) said: its `--set`s (L3 caps
    and policies among them), `--load-mode`, `--no-load-overlap`, `--model`. Tier sizes come from its log
    instead."""
    if not path.exists():
        return []
    words, out = shlex.split(path.read_text()), []
    for i, word in enumerate(words):
        if word in ("--set", "--load-mode") and i + 1 < len(words):
            out += [word, words[i + 1]]
        elif word == "--no-load-overlap":
            out += ["--set", "cache.load_policy.overlap=false"]
        elif word == "--model" and i + 1 < len(words):  # its context limit (the KV bytes come from the log)
            out += ["--set", f"model.name={words[i + 1]}"]
    return out


def predict(workload: Path, config: str, setup: dict[str, int], metrics: Path, output_length: int,
            python: str, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "replay.json"
        cmd = [python, "-m", "hicache.cli", "replay", str(workload), "--config", config, "--no-progress",
               "--calibration", str(metrics), "--output-length", str(output_length), "--json", str(out), *flags]
        for key, value in setup.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        run = subprocess.run(cmd, capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"replay failed ({run.returncode}): {' '.join(cmd)}\n{run.stderr[-2000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument("--config", default="configs/default.yaml", help="the servers' config file")
    p.add_argument("--workload", type=Path, help="the agent sessions (default: OUT_DIR/workload)")
    p.add_argument("--output-length", type=int, default=16, help="as the bench client's --output-length")
    p.add_argument("--json", type=Path, help="write the rows as JSON")
    p.add_argument("--python", default=sys.executable)
    args = p.parse_args(argv)
    workload = args.workload or args.out_dir / "workload"
    rows = []
    for client in sorted(args.out_dir.glob("*.json"), key=lambda q: q.stat().st_mtime):
        arm = client.stem
        if arm.startswith("warmup"):  # a warm-up server ran only some of the sessions
            continue
        log, metrics = args.out_dir / f"{arm}.server.log", args.out_dir / f"{arm}.metrics.txt"
        if not (log.exists() and metrics.exists()):
            continue
        measured = json.loads(client.read_text())["overall"]
        setup = server_setup(log)
        flags_file = args.out_dir / f"{arm}.flags.txt"
        if flags_file.exists() and "--remote-url" in flags_file.read_text():
            print(f"{arm}: skipped (the replay does not model the remote tier)", file=sys.stderr)
            continue
        replay = predict(workload, args.config, setup, metrics, args.output_length, args.python,
                         serve_flags(flags_file))
        t = replay["time"]
        rows.append({"arm": arm, "setup": setup,
                     "measured": {"duration_s": measured["duration_s"],
                                  "ttft_mean_s": measured["ttft_ms"]["mean"] / 1e3,
                                  "errors": measured.get("errors", 0)},
                     "predicted": {"duration_s": t["duration_s"], "ttft_mean_s": t["ttft_s"]["mean"]},
                     "hit_rate": {"measured": measured.get("cache_hit_rate_per_tier"),
                                  "predicted": replay["token_hit_rate"]},
                     "inputs": {**replay["prefill_time"], **t["inputs"]}})
    if not rows:
        print(f"{args.out_dir}: no arm with a client JSON, a server log and a metrics file", file=sys.stderr)
        return 1
    print(f"{'arm':<16}{'duration s':>22}{'ratio':>8}{'TTFT mean s':>24}{'ratio':>8}  hits measured / predicted")
    for r in rows:
        m, q = r["measured"], r["predicted"]
        hits = r["hit_rate"]
        shown = " ".join(f"{k} {100 * (hits['measured'] or {}).get(k, 0):.0f}/{100 * hits['predicted'][k]:.0f}%"
                         for k in ("device", "host", "disk"))
        ratios = q["duration_s"] / m["duration_s"], q["ttft_mean_s"] / m["ttft_mean_s"]
        failed = f"  NOT COMPARABLE: {m['errors']} requests failed on the server" if m["errors"] else ""
        print(f"{r['arm']:<16}{m['duration_s']:>10.2f} / {q['duration_s']:>9.2f}{ratios[0]:>8.3f}"
              f"{m['ttft_mean_s']:>11.3f} / {q['ttft_mean_s']:>10.3f}{ratios[1]:>8.3f}  {shown}{failed}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
