"""The SecondaryTierManager contract, checked on vLLM's own `fs` tier and on `HicacheTier` alike: the same calls,
the same answers. vLLM's tests of its tiers build their tier class in their fixtures rather than take it as a
parameter, so the contract they check (an empty tier misses, a store then a load into other chunks is
byte-exact, a missing chunk fails its load job, jobs report independently, batches of any size, the factory passes
`locality` on and refuses a bad one) is checked here, over both tiers."""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest
from vllm.v1.kv_offload.base import Locality, LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

from tests.integrations.vllm_helpers import offloading_config

CHUNKS = 8
CHUNK_BYTES = 128 * mmap.PAGESIZE
CTX = ReqContext(req_id="contract")


def tier_config(kind: str, tmp_path) -> dict:
    if kind == "fs":
        return {"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 4, "n_write_threads": 4}
    return {"type": "HicacheTier", "module_path": "hicache.integrations.vllm", "path": str(tmp_path / "l3"),
            "size_gib": 0.05}


@pytest.fixture(params=["fs", "hicache"])
def tier(request, tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    buffer = mmap.mmap(-1, CHUNKS * CHUNK_BYTES)
    rows = np.frombuffer(buffer, dtype=np.uint8).reshape(CHUNKS, CHUNK_BYTES)
    spec = TieringOffloadingSpec(offloading_config({}, primary_chunks=CHUNKS))
    made = SecondaryTierFactory.create_secondary_tier(tier_config(request.param, tmp_path), memoryview(rows), spec)
    yield made, rows
    made.shutdown()


def key(n: int):
    return make_offload_key(n.to_bytes(8, "big"), 0)


def job(job_id: int, keys, chunk_ids, promotion: bool = False) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunk_ids, dtype=np.int64),
                       is_promotion=promotion, req_context=CTX)


def drain(tier) -> list:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def lookups(tier, keys, timeout: float = 10.0) -> list[LookupResult]:
    """Look keys up until no answer is RETRY (a tier may answer from a background probe)."""
    deadline = time.monotonic() + timeout
    while True:
        results = [tier.lookup(k, CTX) for k in keys]
        tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if LookupResult.RETRY not in results or time.monotonic() > deadline:
            return results
        time.sleep(0.01)


def test_an_empty_tier_misses(tier):
    made, _ = tier
    assert lookups(made, [key(1), key(2)]) == [LookupResult.MISS] * 2


@pytest.mark.parametrize("batch", [0, 1, 2, 5])
def test_store_then_load_into_other_chunks_is_byte_exact(tier, batch):
    made, rows = tier
    rows[:] = np.random.default_rng(batch).integers(0, 256, rows.shape, dtype=np.uint8)
    keys = [key(i) for i in range(batch)]
    expected = rows[:batch].copy()
    assert [r.success for r in drain_after(made, made.submit_store, job(1, keys, list(range(batch))))] == [True]
    assert lookups(made, keys) == [LookupResult.HIT] * batch
    rows[:] = 0
    targets = list(range(CHUNKS - batch, CHUNKS))
    assert [r.success for r in drain_after(made, made.submit_load, job(2, keys, targets, True))] == [True]
    for i, chunk in enumerate(targets):
        assert np.array_equal(rows[chunk], expected[i])


def drain_after(tier, submit, transfer: TransferJob) -> list:
    submit(transfer)
    return drain(tier)


def test_a_missing_chunk_fails_its_load(tier):
    made, _ = tier
    assert [r.success for r in drain_after(made, made.submit_store, job(1, [key(10), key(11)], [0, 1]))] == [True]
    results = drain_after(made, made.submit_load, job(2, [key(10), key(11), key(99)], [0, 1, 2], True))
    assert [(r.job_id, r.success) for r in results] == [(2, False)]
    assert results[0].successful_keys is None or set(results[0].successful_keys) <= {key(10), key(11)}


def test_jobs_report_independently(tier):
    made, _ = tier
    made.submit_store(job(1, [key(1)], [0]))
    made.submit_store(job(2, [key(2)], [1]))
    assert {r.job_id for r in drain(made)} == {1, 2}
    assert lookups(made, [key(1), key(2)]) == [LookupResult.HIT] * 2


@pytest.mark.parametrize("kind", ["fs", "hicache"])
def test_the_factory_passes_locality_on_and_refuses_a_bad_one(kind, tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    rows = np.zeros((4, CHUNK_BYTES), dtype=np.uint8)
    spec = TieringOffloadingSpec(offloading_config({}, primary_chunks=4))
    made = SecondaryTierFactory.create_secondary_tier({**tier_config(kind, tmp_path), "locality": "LOCAL"},
                                                      memoryview(rows), spec)
    try:
        assert made.locality is Locality.LOCAL
    finally:
        made.shutdown()
    with pytest.raises(ValueError, match="Locality"):
        SecondaryTierFactory.create_secondary_tier({**tier_config(kind, tmp_path / "b"), "locality": "local"},
                                                   memoryview(rows), spec)
