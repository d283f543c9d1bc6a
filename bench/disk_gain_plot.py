"""From which storage speed does the L3 pay, for my model? Duration and mean TTFT of the agent workload against the
L3's bandwidth, from `bash bench/gpu/run.sh agent` runs (bench/RESULTS.md, 'The disk adds its bandwidth').

    python3 bench/disk_gain_plot.py RUN_DIR [RUN_DIR ...] [--out disk_gain.png] [--model-suffix _7b] [--label 8B]

Each RUN_DIR holds the client reports `agent_ARM_I.json` of a gpu_only arm and some of host48 and host12_l3shm_rN
(the L3 on tmpfs capped at N GB/s each way), and optionally host12_l3disk (the machine's disk, drawn at --disk-gbps).
An arm is compared with the GPU-only arm of its own run, so that runs on different leases (a machine's speed moves
between them) can share a plot; an arm in two runs is an error. Prints a markdown table of the ratios to GPU only and
writes the plot (matplotlib, Agg).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys


def load_arms(run: pathlib.Path, suffix: str) -> dict[str, dict]:
    """Arm name (the modifiers after the base, `suffix` removed) -> the report's `overall` figures."""
    arms = {}
    for path in sorted(run.glob("agent_*_[0-9]*.json")):
        arm = path.stem[len("agent_"):].rsplit("_", 1)[0]
        if suffix:
            if not arm.endswith(suffix):
                continue
            arm = arm[: -len(suffix)]
        elif arm.endswith("_7b"):
            continue
        arms[arm] = json.loads(path.read_text())["overall"]
    return arms


def points(arms: dict[str, dict], disk_gbps: float | None) -> tuple[list[tuple[float, float, float, str]], dict]:
    """(GB/s, duration / GPU only, mean TTFT / GPU only, arm) per L3 arm, by bandwidth; and the baselines' ratios."""
    if "gpu_only" not in arms:
        raise SystemExit("disk_gain_plot: no gpu_only arm in the run: nothing to compare with")
    base = arms["gpu_only"]

    def ratio(o: dict) -> tuple[float, float]:
        return o["duration_s"] / base["duration_s"], o["ttft_ms"]["mean"] / base["ttft_ms"]["mean"]

    out = []
    for arm, o in arms.items():
        m = re.fullmatch(r"host12_l3shm_r([0-9.]+)", arm)
        if m:
            out.append((float(m.group(1)), *ratio(o), arm))
        elif arm == "host12_l3disk" and disk_gbps:
            out.append((disk_gbps, *ratio(o), arm))
    baselines = {arm: ratio(arms[arm]) for arm in ("host48", "host12", "host12_l3shm") if arm in arms}
    return sorted(out), baselines


def gather(runs: list[pathlib.Path], suffix: str, disk_gbps: float | None) -> tuple[list, dict]:
    """`points` over several runs, each arm against its own run's GPU-only arm; an arm in two runs is an error."""
    pts: list[tuple[float, float, float, str]] = []
    baselines: dict[str, tuple[float, float]] = {}
    where: dict[str, pathlib.Path] = {}
    for run in runs:
        arms = load_arms(run, suffix)
        if "gpu_only" not in arms:
            raise SystemExit(f"disk_gain_plot: no gpu_only arm in {run}: nothing to compare its arms with")
        run_pts, run_baselines = points(arms, disk_gbps)
        for arm in [x[3] for x in run_pts] + list(run_baselines):
            if arm in where:
                raise SystemExit(f"disk_gain_plot: arm {arm} is in two runs ({where[arm]} and {run}): keep one")
            where[arm] = run
        pts += run_pts
        baselines.update(run_baselines)
    return sorted(pts), baselines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=pathlib.Path, nargs="+",
                   help="folders of agent runs (an agent.tgz unpacked: .../agent), each with its gpu_only arm")
    p.add_argument("--out", default="disk_gain.png", help="plot file (PNG)")
    p.add_argument("--model-suffix", default="", help="take the arms with this suffix, e.g. _7b")
    p.add_argument("--disk-gbps", type=float, help="draw host12_l3disk at this read bandwidth")
    p.add_argument("--label", help="the model, for the title (default: the suffix, e.g. 7B)")
    args = p.parse_args(argv)
    pts, baselines = gather(args.run, args.model_suffix, args.disk_gbps)
    print("| arm | L3 GB/s | duration / GPU only | mean TTFT / GPU only |\n|---|---|---|---|")
    for gbps, dur, ttft, arm in pts:
        print(f"| {arm} | {gbps:g} | {dur:.3f} | {ttft:.3f} |")
    for arm, (dur, ttft) in baselines.items():
        print(f"| {arm} | | {dur:.3f} | {ttft:.3f} |")
    if not pts:
        print("disk_gain_plot: no rate-limited L3 arm (host12_l3shm_rN) in the run", file=sys.stderr)
        return 1
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the capped tmpfs arms are the curve; the machine's disk is one point on it at its read speed, drawn apart (its
    # writes share the drive, and its speed is an estimate); tmpfs without a cap is the curve's ceiling
    capped = [x for x in pts if x[3] != "host12_l3disk"]
    disk = [x for x in pts if x[3] == "host12_l3disk"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, col, title in ((axes[0], 1, "duration"), (axes[1], 2, "mean TTFT")):
        ax.plot([x[0] for x in capped], [x[col] for x in capped], "o-", label="host 12 GiB + L3 on tmpfs, capped")
        for x in disk:
            ax.plot([x[0]], [x[col]], "*", color="tab:red", markersize=12,
                    label=f"host 12 GiB + L3 on the disk (at {x[0]:g} GB/s)")
        for arm, style, label in (("host48", "--", "host 48 GiB"), ("host12", ":", "host 12 GiB"),
                                  ("host12_l3shm", "-.", "host 12 GiB + L3 on tmpfs, no cap")):
            if arm in baselines:
                ax.axhline(baselines[arm][col - 1], linestyle=style, color="gray", label=label)
        ax.axhline(1.0, color="black", linewidth=0.8, label="GPU only")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("L3 bandwidth, GB/s each way")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("ratio to GPU only")
    label = args.label or args.model_suffix.strip("_").upper()
    fig.suptitle(f"agent sessions{' (' + label + ')' if label else ''}: the L3's gain by its bandwidth", fontsize=10)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
