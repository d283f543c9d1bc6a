"""random:tiny on the CPU with host -> GPU copies that stream in layer by layer (a stand-in for
tiers/layered_copy.py): a request starts while its prefix is still landing, its forward waits for each layer's
copy before that layer, a copy that fails part-way makes it recompute, and host pages load rather than being
recomputed while the GPU is busy. The CUDA tests at the end do the same with the real copier (its own tests:
tests/test_layered_copy.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sched_helpers import assert_no_leaks, make_engine, run_all

from hicache.engine.params import SamplingParams
from hicache.engine.request import Status
from hicache.engine.weights import load_model
from radix import HOST

PAGE = 4
A = [(5 * 17 + i * 11) % 250 + 1 for i in range(81)]  # 20 full pages and one token
DEVICE_TOKENS = 96


def other(n: int) -> list[int]:
    return [(7 * 13 + i * 3) % 250 + 1 for i in range(n)]

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


class StreamingCopy:
    """A copy that has run (on the CPU, at once) but reports itself in flight, layer by layer, until `land()`."""

    streams = True

    def __init__(self, log: list[tuple[str, int]], failed: bool = False):
        self.log = log
        self.landed = False
        self.failed = failed

    def done(self) -> bool:
        return self.landed

    def wait(self) -> None:
        self.landed = True

    def land(self) -> None:
        self.landed = True

    def stream_wait(self, stream: Any = None) -> None:
        self.log.append(("whole", -1))

    def stream_wait_layer(self, layer: int, stream: Any = None) -> None:
        assert not self.failed, "a forward waited on a failed load"
        self.log.append(("layer", layer))


class StreamingCopier:
    """The engine's copier with every load wrapped in a StreamingCopy (failing on the `fail` next loads)."""

    def __init__(self, inner: Any, landed: bool = False):
        self.inner = inner
        self.landed = landed  # copies land at once (for tests of what is loaded, not of when)
        self.log: list[tuple[str, int]] = []
        self.copies: list[StreamingCopy] = []
        self.fail = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def to_device(self, host_pages: Any, device_pages: Any, after: Any = None) -> StreamingCopy:
        failed = self.fail > 0
        self.fail -= failed
        if not failed:
            self.inner.to_device(host_pages, device_pages)
        copy = StreamingCopy(self.log, failed)
        copy.landed = self.landed
        self.copies.append(copy)
        return copy


def host_engine(tiny, device_tokens: int = DEVICE_TOKENS, landed: bool = False, **dotted):
    """GPU `device_tokens`, host 512: A (85 tokens with its output) leaves the GPU when a prompt that fills it comes,
    and stays in host memory."""
    dotted.setdefault("cache__load_policy__overlap", True)
    engine = make_engine(tiny, cache__page_size=PAGE, cache__device__size_tokens=device_tokens,
                         cache__host__size_tokens=512, **dotted)
    ctrl = engine.cache.controller
    copier = StreamingCopier(ctrl.copier.copier, landed)
    ctrl.copier.copier = copier  # under the LaunchLater the controller holds
    return engine, copier


def first_logits(engine) -> dict[str, torch.Tensor]:
    """Record each request's first-token logits as the engine computes them."""
    seen: dict[str, torch.Tensor] = {}
    forward = engine._forward

    def recording(plan, waits=()):
        logits = forward(plan, waits)
        for row, (req, n) in enumerate(plan):
            if req.request_id not in seen and req.computed + n == len(req.token_ids):
                seen[req.request_id] = logits[row].clone()
        return logits

    engine._forward = recording
    return seen


def evict_a_to_host(engine, device_tokens: int = DEVICE_TOKENS) -> None:
    """A computed, then a prompt that fills the GPU pushes it out: its pages are in host memory only."""
    engine.add_request("a0", A, GREEDY)
    run_all(engine)
    engine.add_request("b", other(device_tokens - GREEDY.max_tokens), GREEDY)
    run_all(engine)
    node = engine.cache.controller.tree.match_prefix(A, touch=False).last_node
    assert node.on_host and not node.on_device


def miss_logits(engine) -> torch.Tensor:
    """A's first-token logits on a fresh engine: its prefix computed, nothing cached."""
    seen = first_logits(engine)
    engine.add_request("a", A, GREEDY)
    run_all(engine)
    return seen["a"].cpu()


def test_a_request_runs_while_its_prefix_streams_in_and_waits_per_layer(tiny):
    expected = miss_logits(host_engine(tiny)[0])
    engine, copier = host_engine(tiny)
    evict_a_to_host(engine)
    seen = first_logits(engine)
    copier.log.clear()
    engine.add_request("a", A, GREEDY)
    engine.step()  # admitted: its load is asked for, then launched once the (empty) step ends
    req = engine.requests["a"]
    assert req.ticket.hit_pages == {HOST: 20} and not req.ticket.ready()
    engine.step()  # starts while the copy is still in flight: the forward waits for it layer by layer
    assert req.status is Status.RUNNING and not copier.copies[-1].landed
    layers = tiny[0].config.num_layers
    assert copier.log == [("layer", i) for i in range(layers)]
    for copy in copier.copies:
        copy.land()
    out = run_all(engine)["a"][2]
    assert out.usage.cached_tokens[HOST] == out.usage.total_cached_tokens == 80
    torch.testing.assert_close(seen["a"], expected, atol=1e-4, rtol=1e-4)
    assert copier.log == [("layer", i) for i in range(layers)]  # later steps read pages the first forward waited for
    assert_no_leaks(engine)


def test_a_load_that_fails_part_way_is_recomputed(tiny):
    expected = miss_logits(host_engine(tiny)[0])
    engine, copier = host_engine(tiny)
    evict_a_to_host(engine)
    seen = first_logits(engine)
    copier.fail = 1
    copier.log.clear()
    engine.add_request("a", A, GREEDY)
    engine.step()
    engine.step()
    assert ("layer", 0) not in copier.log  # nothing ran on the failed load
    for copy in copier.copies:
        copy.land()
    ids, _, out = run_all(engine)["a"]
    assert out.usage.total_cached_tokens == 0  # the prefix was recomputed
    torch.testing.assert_close(seen["a"], expected, atol=1e-4, rtol=1e-4)
    assert engine.cache.controller.tree.match_prefix(A, touch=False).num_pages == 20  # and cached again
    assert_no_leaks(engine)


def slow_host(tiny) -> dict[str, Any]:
    """Costs where loading a host page (8 ms) is dearer than computing it (4 ms at 1,000 tokens/s)."""
    c = tiny[0].config
    page_bytes = c.num_layers * 2 * PAGE * c.num_kv_heads * c.head_dim * 4
    return {"cache__load_policy__prefill_tokens_per_s": 1000.0,
            "cache__load_policy__host_to_device_gbps": page_bytes / 0.008 / 1e9,
            "cache__load_policy__overlap": False}


def test_host_pages_dearer_than_compute_are_recomputed_when_idle_and_counted_by_tier(tiny):
    engine, copier = host_engine(tiny, landed=True, **slow_host(tiny))
    evict_a_to_host(engine)
    engine.add_request("a", A, GREEDY)
    out = run_all(engine)["a"][2]
    assert out.usage.total_cached_tokens == 0
    cache = engine.stats()["cache"]
    assert cache["recomputed_by_tier"][HOST] == 80 and cache["recomputed_tokens"] == 80
    assert_no_leaks(engine)


def test_host_pages_load_while_the_gpu_is_busy_whatever_they_cost(tiny):
    engine, copier = host_engine(tiny, 2 * DEVICE_TOKENS, landed=True, **slow_host(tiny))
    evict_a_to_host(engine, 2 * DEVICE_TOKENS)
    engine.add_request("other", other(40)[::-1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    engine.step()  # "other" runs: the GPU has work queued when A is admitted
    engine.add_request("a", A, GREEDY)
    results = run_all(engine)
    usage = results["a"][2].usage
    assert usage.cached_tokens[HOST] == usage.total_cached_tokens == 80
    assert engine.stats()["cache"]["recomputed_by_tier"][HOST] == 0
    assert_no_leaks(engine)


# ---------------------------------------------------------------------------------------------- on CUDA


def cuda_engine(tiny_cuda, mode: str, **dotted):
    """random:tiny on CUDA, GPU 96 tokens, host 512, with the real copier in `mode`."""
    import tiers.cuda_copy as cuda_copy

    pytest.importorskip("cupy")
    # the copier picks its mode by page size when it is built: force the one under test
    cuda_copy.ZERO_COPY_MAX_PAGE_BYTES, saved = (1 << 40 if mode == "zero_copy" else 0), \
        cuda_copy.ZERO_COPY_MAX_PAGE_BYTES
    try:
        engine = make_engine(tiny_cuda, model__device="cuda", cache__page_size=PAGE,
                             cache__device__size_tokens=DEVICE_TOKENS, cache__host__size_tokens=512, **dotted)
    finally:
        cuda_copy.ZERO_COPY_MAX_PAGE_BYTES = saved
    assert engine.cache.controller.copier.copier.mode == mode
    return engine


@pytest.fixture(scope="module")
def tiny_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.backends.cuda.matmul.allow_tf32 = False
    return load_model("random:tiny", torch.float32, torch.device("cuda"))


def host_hit_logits(engine, fail_at_layer: int | None = None) -> tuple[torch.Tensor, Any]:
    """A's first-token logits with its prefix in host memory only; the copy stream is held up before A's load
    (a spin kernel), so a forward that did not wait for it would read stale pages."""
    evict_a_to_host(engine)
    seen = first_logits(engine)
    inner = engine.cache.controller.copier.copier
    if inner.layers is not None:
        inner.layers.fail_at_layer = fail_at_layer
    with torch.cuda.stream(inner.layers.copy_stream if inner.layers is not None else inner.copy_stream):
        torch.cuda._sleep(100_000_000)
    engine.add_request("a", A, GREEDY)
    out = run_all(engine)["a"][2]
    assert_no_leaks(engine)
    return seen["a"].cpu(), out


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dma", "zero_copy"])
def test_cuda_layered_load_gives_the_logits_of_a_whole_load_and_of_a_miss(tiny_cuda, mode):
    expected = miss_logits(cuda_engine(tiny_cuda, mode))
    layered, out = host_hit_logits(cuda_engine(tiny_cuda, mode))
    assert out.usage.cached_tokens[HOST] == out.usage.total_cached_tokens == 80
    whole, out = host_hit_logits(cuda_engine(tiny_cuda, mode, cache__load_policy__layered=False))
    assert out.usage.cached_tokens[HOST] == 80
    torch.testing.assert_close(layered, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layered, expected, atol=1e-3, rtol=1e-3)


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["dma", "zero_copy"])
def test_cuda_load_failing_at_a_layer_is_recomputed_like_a_miss(tiny_cuda, mode):
    expected = miss_logits(cuda_engine(tiny_cuda, mode))
    got, out = host_hit_logits(cuda_engine(tiny_cuda, mode), fail_at_layer=1)
    assert out.usage.total_cached_tokens == 0
    torch.testing.assert_close(got, expected, atol=1e-3, rtol=1e-3)
