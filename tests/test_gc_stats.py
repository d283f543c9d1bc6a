"""hicache.gc_stats: collections timed, startup frozen, the snapshot /metrics reads."""

from __future__ import annotations

import gc

from hicache import gc_stats


def test_timer_adds_up_collections_and_keeps_the_longest() -> None:
    timer = gc_stats.GcTimer().install()
    try:
        assert timer in gc.callbacks
        for _ in range(3):
            gc.collect()
        assert timer.total > 0 and 0 < timer.longest <= timer.total
        assert timer.install() is timer and gc.callbacks.count(timer) == 1  # installing twice adds it once
    finally:
        timer.remove()
    assert timer not in gc.callbacks
    total = timer.total
    gc.collect()
    assert timer.total == total  # removed: no longer called


def test_freeze_startup_moves_live_objects_out_of_collection() -> None:
    try:
        kept = [{"n": i} for i in range(1000)]  # alive at the freeze: frozen with everything else
        frozen = gc_stats.freeze_startup()
        # frozen objects can only leave the permanent generation (when freed, by another test's thread too), so
        # the count read later is at most the one returned
        assert frozen > len(kept) and len(kept) < gc.get_freeze_count() <= frozen
        snap = gc_stats.snapshot()
        assert len(kept) < snap["frozen"] <= frozen and len(snap["collections"]) == 3
    finally:
        gc.unfreeze()  # the rest of the test session collects as usual
    assert gc.get_freeze_count() == 0


def test_snapshot_reads_the_process_timer() -> None:
    timer = gc_stats.process_timer()
    assert gc_stats.process_timer() is timer and timer in gc.callbacks
    gc.collect()
    snap = gc_stats.snapshot()
    assert snap["seconds"] == timer.total > 0 and snap["longest_s"] == timer.longest > 0
