"""Capacity sweeps: replay a grid of tier sizes and plot hit rate per tier against capacity."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from radix import TIERS

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_sweep(specs: Sequence[str]) -> dict[str, list[int]]:
    """Parse `tier=A,B,C` specs (token counts, k/M/G suffixes allowed); ValueError on bad input."""
    grid: dict[str, list[int]] = {}
    for spec in specs:
        tier, sep, values = spec.partition("=")
        tier = tier.strip()
        if not sep or tier not in TIERS:
            raise ValueError(f"--sweep {spec!r}: expected TIER=A,B,C with TIER one of {list(TIERS)}")
        if tier in grid:
            raise ValueError(f"--sweep: {tier} given twice")
        out = []
        for v in values.split(","):
            v = v.strip().lower()
            mult = _SUFFIX.get(v[-1:], 1)
            try:
                n = int(float(v[:-1] if mult != 1 else v) * mult)
            except ValueError:
                raise ValueError(f"--sweep {spec!r}: {v!r} is not a token count") from None
            if n < 0:
                raise ValueError(f"--sweep {spec!r}: sizes must be >= 0")
            out.append(n)
        grid[tier] = out
    return grid


def grid_points(grid: dict[str, list[int]]) -> list[dict[str, int]]:
    """Every combination of the swept sizes (tokens), in the order given."""
    names = list(grid)
    return [dict(zip(names, combo)) for combo in itertools.product(*(grid[n] for n in names))]


def run_sweep(grid: dict[str, list[int]], replay_point: Callable[[dict[str, int]], dict[str, Any]]) -> list[dict]:
    """Run replay_point for each grid point; a point it rejects (ValueError) is kept with `skipped`."""
    points = []
    for sizes in grid_points(grid):
        try:
            summary = replay_point(sizes)
        except ValueError as e:
            points.append({"sizes_tokens": sizes, "skipped": str(e)})
            continue
        points.append({"sizes_tokens": sizes, **summary})
    return points


def _gib(tokens: int, kv_bytes_per_token: int) -> str:
    return f"{tokens * kv_bytes_per_token / 2**30:,.1f} GiB" if kv_bytes_per_token else f"{tokens:,} tokens"


def plot_sweep(points: list[dict], grid: dict[str, list[int]], path: str, trace_name: str = "",
               kv_bytes_per_token: int = 0, fixed_sizes: dict[str, int] | None = None, policy: str = "") -> None:
    """PNG of hit rate per tier (and total) against the last swept tier's capacity, one panel per combination of
    the other swept sizes. The figure names the trace, the sizes held fixed and the policies; the x axis is in GiB
    (blocks' KV bytes) where the KV bytes per token are known, else in thousands of tokens; panel titles give the
    sizes used; a point the replay refused (e.g. disk without host) is marked as skipped where it would have been."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x_tier = list(grid)[-1]
    others = [t for t in grid if t != x_tier]
    panels = grid_points({t: grid[t] for t in others}) if others else [{}]
    scale = kv_bytes_per_token / 2**30 if kv_bytes_per_token else 1e-3
    unit = "GiB" if kv_bytes_per_token else "thousand tokens"
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 4.2), squeeze=False, sharey=True)
    for ax, fixed in zip(axes[0], panels):
        mine = [p for p in points if all(p["sizes_tokens"][k] == v for k, v in fixed.items())]
        rows = sorted((p for p in mine if "skipped" not in p), key=lambda p: p["sizes_tokens"][x_tier])
        xs = [p["sizes_tokens"][x_tier] * scale for p in rows]
        for tier in TIERS:
            ax.plot(xs, [p["hit_rate"][tier] for p in rows], marker="o", label=tier)
        ax.plot(xs, [p["total_hit_rate"] for p in rows], marker="s", color="black", label="total")
        skipped = [p["sizes_tokens"][x_tier] * scale for p in mine if "skipped" in p]
        if skipped:
            ax.plot(skipped, [0.0] * len(skipped), "x", color="red", markersize=9, label="skipped (refused)")
        ax.set_xlabel(f"{x_tier} tier capacity ({unit})")
        title = ", ".join(f"{k} {_gib(v, kv_bytes_per_token)}" for k, v in fixed.items())
        ax.set_title(title or f"{x_tier} tier swept", fontsize=9)
        ax.set_ylim(-0.03, 1.0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("hit rate (fraction of blocks)")
    axes[0][0].legend(fontsize=8)
    held = ", ".join(f"{k} {_gib(v, kv_bytes_per_token)}" for k, v in (fixed_sizes or {}).items()
                     if k not in grid and v is not None)
    fig.suptitle("; ".join(x for x in (trace_name, f"fixed: {held}" if held else "", policy) if x), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
