"""The costs a running server measured, for a replay to price with: `hicache replay --calibration SOURCE`.

`hicache serve` times its prefill (and the attention cost per token of context) at startup and follows the disk's
measured reads; /metrics exports what its cost model uses now (`hicache_cost_prefill_tokens_per_second`,
`hicache_cost_attention_ns_per_pair`, `hicache_cost_load_gbps{tier}`), what its decode-only steps took
(`hicache_cost_decode_step_seconds`, `hicache_cost_decode_seconds_per_sequence`: the time model's decode costs) and
how long its engine thread scheduled a step with prefill besides the forward (`hicache_engine_prefill_schedule_seconds`
over `hicache_engine_prefill_steps`; from an older server, the mean over all steps). SOURCE is that text saved to a file
(`curl -s http://HOST:PORT/metrics > server.metrics`) or the server's address. The cost-model values fold into the
config's `cache.load_policy`, so a replay's load-or-recompute decisions and its prefill times use the server's own
numbers; flags still override them. A 0 in the metrics means unknown and is left out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hicache.replay.core import ReplayError


@dataclass(frozen=True)
class Calibration:
    """What a server's cost model uses; None where it did not know."""

    prefill_tokens_per_s: float | None = None
    attention_ns_per_pair: float | None = None
    host_to_device_gbps: float | None = None
    disk_to_device_gbps: float | None = None
    # what its decode-only steps took (a fit of step time against sequences): for the time model, not the config
    decode_step_s: float | None = None
    decode_seq_s: float | None = None
    # the engine thread's scheduling a step, less what overlapped the forward: what a step costs beyond its forward
    step_overhead_s: float | None = None


LOAD_POLICY_FIELDS = ("prefill_tokens_per_s", "attention_ns_per_pair", "host_to_device_gbps", "disk_to_device_gbps")


def read_calibration(source: str) -> Calibration:
    """The cost-model figures in a /metrics text (a file, or fetched from http(s)://HOST:PORT[/metrics])."""
    if source.startswith(("http://", "https://")):
        import httpx

        url = source if source.rstrip("/").endswith("/metrics") else source.rstrip("/") + "/metrics"
        try:
            r = httpx.get(url, timeout=10.0)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ReplayError(f"--calibration {source}: cannot read the server's metrics: {e}") from None
        text = r.text
    else:
        try:
            text = Path(source).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ReplayError(f"--calibration {source}: cannot read it: {e}") from None
    return parse_calibration(text, source)


def parse_calibration(text: str, source: str = "<metrics>") -> Calibration:
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    engine: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "hicache_cost_prefill_tokens_per_second":
                    values["prefill_tokens_per_s"] = s.value
                elif s.name == "hicache_cost_attention_ns_per_pair":
                    values["attention_ns_per_pair"] = s.value
                elif s.name == "hicache_cost_load_gbps" and s.labels.get("tier") in ("host", "disk"):
                    values[f"{s.labels['tier']}_to_device_gbps"] = s.value
                elif s.name == "hicache_cost_decode_step_seconds":
                    values["decode_step_s"] = s.value
                elif s.name == "hicache_cost_decode_seconds_per_sequence":
                    values["decode_seq_s"] = s.value
                elif s.name in ("hicache_engine_steps_total", "hicache_engine_schedule_seconds_total",
                                "hicache_engine_schedule_overlapped_seconds_total",
                                "hicache_engine_prefill_steps_total", "hicache_engine_prefill_schedule_seconds_total"):
                    engine[s.name] = s.value
    except ValueError as e:
        raise ReplayError(f"--calibration {source}: not Prometheus text: {e}") from None
    if not values:
        raise ReplayError(f"--calibration {source}: no hicache_cost_* metrics in it (is it a hicache server's "
                          "/metrics?)")
    steps = engine.get("hicache_engine_steps_total", 0)
    prefill_steps = engine.get("hicache_engine_prefill_steps_total", 0)
    if prefill_steps > 0 and "hicache_engine_prefill_schedule_seconds_total" in engine:
        # the time model adds it to steps with prefill; decode-only steps carry theirs in the decode fit
        values["step_overhead_s"] = engine["hicache_engine_prefill_schedule_seconds_total"] / prefill_steps
    elif steps > 0 and "hicache_engine_schedule_seconds_total" in engine:  # a server without the split: the mean
        own = engine["hicache_engine_schedule_seconds_total"] - engine.get(
            "hicache_engine_schedule_overlapped_seconds_total", 0.0)
        values["step_overhead_s"] = max(0.0, own) / steps
    zero_known = ("attention_ns_per_pair", "decode_seq_s", "step_overhead_s")  # 0 is a measured value for these
    known = {k: v for k, v in values.items() if v > 0 or (k in zero_known and v == 0)}
    return Calibration(**known)


def apply_calibration(cfg: Any, cal: Calibration) -> Any:
    """cfg with the calibration's known values as its cache.load_policy costs."""
    given = {k: v for k, v in dataclasses.asdict(cal).items() if v is not None and k in LOAD_POLICY_FIELDS}
    lp = dataclasses.replace(cfg.cache.load_policy, **given)
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, load_policy=lp))
