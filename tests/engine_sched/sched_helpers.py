"""Helpers for scheduler/engine tests: engines from small dotted configs, run-to-idle, leak checks."""

from __future__ import annotations

from typing import Any

from hicache.config import Config, override
from hicache.engine.builder import build_engine
from hicache.engine.engine import Engine


def make_engine(model_pair: tuple[Any, Any], **dotted: Any) -> Engine:
    """An Engine on CPU/float32 over `model_pair`; dotted config keys use '__' for '.' (cache__page_size=4). Every
    page the write policy sends reaches the L3 (`l3_admit: all`), and queued writes may pin the whole host pool
    (`l3_host_share: 1.0`, whose share of these few-page pools would be a page or two), unless `dotted` says
    otherwise: these tests are of where pages go; the reuse rule and the shares have tests of their own
    (tests/test_l3_admit.py)."""
    model, tokenizer = model_pair
    values = {"model.name": model.config.name, "model.device": "cpu", "model.dtype": "float32",
              "cache.host.size_gib": None, "cache.host.size_tokens": 0, "cache.write_policy.l3_admit": "all",
              "cache.write_policy.l3_host_share": 1.0}
    values.update({k.replace("__", "."): v for k, v in dotted.items()})
    host_tokens = values.pop("cache.host.size_tokens")
    cfg = override(Config(), {k: v for k, v in values.items() if not k.startswith("cache.host")})
    cfg = override(cfg, {"cache.host": {"size_tokens": host_tokens}})
    return build_engine(cfg, model, tokenizer, calibrate=False)


def run_all(engine: Engine, check: bool = True) -> dict[str, Any]:
    """Step until idle; returns request id -> (token ids, text, final StepOutput); integrity after every step."""
    results: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            ids, text, _ = results.get(out.request_id, ([], "", None))
            results[out.request_id] = (ids + out.new_token_ids, text + out.text_delta, out)
        if check:
            engine.cache.controller.check_integrity()
    return results


def settle_l3(engine: Engine) -> None:
    """Wait for queued L3 I/O and apply it (so a later match sees what was written), also the writes that waited
    for the queue or for the writes' share of host memory (each round queues more of them)."""
    ctrl = engine.cache.controller
    while True:
        waiting = ctrl.writes.waiting_disk_pages
        ctrl.worker.wait_idle()
        ctrl.poll()
        if not ctrl.writes.waiting_disk or ctrl.writes.waiting_disk_pages >= waiting:
            return


def assert_no_leaks(engine: Engine) -> None:
    """No request holds anything: GPU pages are all tree-owned, no private pages, no locks."""
    settle_l3(engine)
    ctrl = engine.cache.controller
    ctrl.check_integrity()
    assert not ctrl.commits.private
    assert ctrl.device.used_pages() == len(ctrl.tree.owned_pages("device"))
    assert all(node.lock_ref == 0 and node.pin_ref == 0 for node in ctrl.tree.nodes())
    assert ctrl.loads.prefetching == 0
    assert ctrl.transfers.in_flight() == 0
    assert ctrl.tree.root.lock_ref == 1
    s = engine.scheduler
    assert not (s.waiting or s.loading or s.running or s.draining)
