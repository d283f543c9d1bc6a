"""Sweeps: replay a grid of tier sizes and bandwidths; plot hit rates, and the predicted time, against them.

`--sweep KEY=A,B,C`, repeatable for a grid. KEY is a tier (device, host, disk: its capacity in tokens, with k/M/G
suffixes, or in bytes with KiB/MiB/GiB/TiB or kB/MB/GB/TB, turned into tokens by the model's KV bytes per token), or
a bandwidth in GB/s: host_gbps (host <-> GPU), disk_gbps (disk reads, and writes unless disk_write_gbps is given),
disk_write_gbps.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from typing import Any

from radix import TIERS

BANDWIDTHS = ("host_gbps", "disk_gbps", "disk_write_gbps")
SWEEP_KEYS = (*TIERS, *BANDWIDTHS)
_COUNT = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_BYTES = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
          "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_VALUE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)$")


def _tokens(spec: str, v: str, kv_bytes_per_token: int) -> int:
    m = _VALUE.match(v)
    unit = m.group(2) if m else None
    if m is None or (unit not in _COUNT and unit not in _BYTES):
        raise ValueError(f"--sweep {spec!r}: {v!r} is not a token count (k/M/G) or a size (GiB, GB, ...)")
    number = float(m.group(1))
    if unit in _BYTES:
        if not kv_bytes_per_token:
            raise ValueError(f"--sweep {spec!r}: a size in bytes needs the KV bytes per token (--kv-bytes-per-token)")
        return int(number * _BYTES[unit] // kv_bytes_per_token)
    return int(number * _COUNT[unit])


def parse_sweep(specs: Sequence[str], kv_bytes_per_token: int = 0) -> dict[str, list[float]]:
    """Parse `KEY=A,B,C` specs: tiers in tokens (sizes in bytes converted), bandwidths in GB/s; ValueError on bad
    input."""
    grid: dict[str, list[float]] = {}
    for spec in specs:
        key, sep, values = spec.partition("=")
        key = key.strip()
        if not sep or key not in SWEEP_KEYS:
            raise ValueError(f"--sweep {spec!r}: expected KEY=A,B,C with KEY one of {list(SWEEP_KEYS)}")
        if key in grid:
            raise ValueError(f"--sweep: {key} given twice")
        out: list[float] = []
        for v in values.split(","):
            v = v.strip().lower()
            if key in TIERS:
                n: float = _tokens(spec, v, kv_bytes_per_token)
            else:
                try:
                    n = float(v)
                except ValueError:
                    raise ValueError(f"--sweep {spec!r}: {v!r} is not a bandwidth in GB/s") from None
                if not n > 0:
                    raise ValueError(f"--sweep {spec!r}: bandwidths must be > 0")
            if n < 0:
                raise ValueError(f"--sweep {spec!r}: sizes must be >= 0")
            out.append(n)
        grid[key] = out
    return grid


def grid_points(grid: dict[str, list[float]]) -> list[dict[str, float]]:
    """Every combination of the swept values, in the order given."""
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def run_sweep(grid: dict[str, list[float]], replay_point: Callable[[dict[str, float]], dict[str, Any]]) -> list[dict]:
    """Run replay_point for each grid point; a point it rejects (ValueError) is kept with `skipped`."""
    points = []
    for values in grid_points(grid):
        try:
            summary = replay_point(values)
        except ValueError as e:
            points.append({"sweep": values, "skipped": str(e)})
            continue
        points.append({"sweep": values, **summary})
    return points


def _label(key: str, value: float, kv_bytes_per_token: int) -> str:
    if key in BANDWIDTHS:
        return f"{key.replace('_gbps', '')} {value:g} GB/s"
    if kv_bytes_per_token:
        return f"{key} {value * kv_bytes_per_token / 2**30:,.1f} GiB"
    return f"{key} {value:,.0f} tokens"


def plot_sweep(points: list[dict], grid: dict[str, list[float]], path: str, trace_name: str = "",
               kv_bytes_per_token: int = 0, fixed: str = "", policy: str = "") -> None:
    """PNG of hit rate per tier (and total) against the last swept key, one panel per combination of the other
    swept values, and below it (a timed replay) the predicted TTFT (mean, p50, p90) and duration. The figure names
    the trace, what was held fixed and the policies; a tier's axis is in GiB where the KV bytes per token are known,
    else in thousands of tokens; a point the replay refused (e.g. disk without host) is marked where it would have
    been."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_key = list(grid)[-1]
    others = [k for k in grid if k != x_key]
    panels = grid_points({k: grid[k] for k in others}) if others else [{}]
    if x_key in BANDWIDTHS:
        scale, unit = 1.0, "GB/s"
    else:
        scale = kv_bytes_per_token / 2**30 if kv_bytes_per_token else 1e-3
        unit = "GiB" if kv_bytes_per_token else "thousand tokens"
    timed = any("time" in p for p in points)
    rows = 2 if timed else 1
    fig, axes = plt.subplots(rows, len(panels), figsize=(4.8 * len(panels), 4.0 * rows), squeeze=False,
                             sharex="col")
    for col, held in enumerate(panels):
        mine = [p for p in points if all(p["sweep"][k] == v for k, v in held.items())]
        ok = sorted((p for p in mine if "skipped" not in p), key=lambda p: p["sweep"][x_key])
        xs = [p["sweep"][x_key] * scale for p in ok]
        ax = axes[0][col]
        for tier in TIERS:
            ax.plot(xs, [p["hit_rate"][tier] for p in ok], marker="o", label=tier)
        ax.plot(xs, [p["total_hit_rate"] for p in ok], marker="s", color="black", label="total")
        skipped = [p["sweep"][x_key] * scale for p in mine if "skipped" in p]
        if skipped:
            ax.plot(skipped, [0.0] * len(skipped), "x", color="red", markersize=9, label="skipped (refused)")
        ax.set_title(", ".join(_label(k, v, kv_bytes_per_token) for k, v in held.items()) or f"{x_key} swept",
                     fontsize=9)
        ax.set_ylim(-0.03, 1.0)
        ax.set_ylabel("hit rate (fraction of blocks)")
        ax.grid(alpha=0.3)
        if timed:
            tx = [p["sweep"][x_key] * scale for p in ok if "time" in p]
            tp = [p["time"] for p in ok if "time" in p]
            ax2 = axes[1][col]
            for key, style in (("mean", "o-"), ("p50", "s--"), ("p90", "^:")):
                ax2.plot(tx, [t["ttft_s"][key] for t in tp], style, label=f"TTFT {key}")
            ax2.set_ylabel("predicted TTFT (s)")
            ax2.set_xlabel(f"{x_key} ({unit})")
            ax2.grid(alpha=0.3)
            dur = ax2.twinx()
            dur.plot(tx, [t["duration_s"] for t in tp], "k-", marker="D", label="duration")
            dur.set_ylabel("predicted duration (s)")
            lines = ax2.get_legend_handles_labels()
            more = dur.get_legend_handles_labels()
            ax2.legend(lines[0] + more[0], lines[1] + more[1], fontsize=8)
        else:
            ax.set_xlabel(f"{x_key} ({unit})")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("; ".join(x for x in (trace_name, f"fixed: {fixed}" if fixed else "", policy) if x), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
