"""Summary of `bench/gpu/run.sh noloss`: each server's rounds, their medians, and tiers on against tiers off.

    python bench/gpu/noloss_summary.py OUT_DIR

Each server (NAME = nr<case>_<arm>) served several rounds of fresh random prompts, one client JSON per round
(NAME.s<seed>.json). One round of 32 requests lasts a few seconds, so its TTFT p50 moves by a few percent from round to
round on the same server; the comparison uses the median over rounds of each figure, against the `off` server of the
same case. Exit status 1 when there are no rounds, or a case has no `off` server.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

_ROUND = re.compile(r"^(nr[^_]+)_(.+)\.s(\d+)\.json$")
FIGURES = (("p50", lambda o: o["ttft_ms"]["p50"]), ("mean", lambda o: o["ttft_ms"]["mean"]),
           ("tok/s", lambda o: o["input_tokens_per_s"]))


def collect(out: Path) -> dict[str, dict[str, list[dict]]]:
    """{case: {arm: [overall figures of each round, by seed]}}."""
    runs: dict[str, dict[str, list[tuple[int, dict]]]] = defaultdict(lambda: defaultdict(list))
    for p in out.glob("nr*.s*.json"):
        m = _ROUND.match(p.name)
        if m:
            runs[m.group(1)][m.group(2)].append((int(m.group(3)), json.loads(p.read_text())["overall"]))
    return {case: {arm: [o for _, o in sorted(rs, key=lambda r: r[0])] for arm, rs in arms.items()}
            for case, arms in runs.items()}


def medians(rounds: list[dict]) -> dict[str, float]:
    return {name: statistics.median(get(o) for o in rounds) for name, get in FIGURES}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    runs = collect(Path(argv[0]))
    if not runs:
        print(f"noloss_summary: no nr*.s*.json rounds in {argv[0]}", file=sys.stderr)
        return 1
    bad = 0
    for case, arms in sorted(runs.items()):
        off = arms.get("off")
        if not off:
            print(f"{case}: no 'off' server to compare with")
            bad = 1
            continue
        base = medians(off)
        for arm, rounds in sorted(arms.items(), key=lambda a: (a[0] != "off", a[0])):
            med = medians(rounds)
            per_round = " ".join(f"{o['ttft_ms']['p50']:.0f}/{o['input_tokens_per_s']:.0f}" for o in rounds)
            line = (f"{case:6s} {arm:10s} {len(rounds)} rounds  median TTFT p50 {med['p50']:8.1f} ms  mean "
                    f"{med['mean']:8.1f} ms  in {med['tok/s']:8.0f} tok/s")
            if arm != "off":
                line += (f"  vs off: p50 {med['p50'] / base['p50']:.3f}x  mean {med['mean'] / base['mean']:.3f}x"
                         f"  tok/s {med['tok/s'] / base['tok/s']:.3f}x")
            print(line + f"  (rounds p50 ms/tok/s: {per_round})")
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
