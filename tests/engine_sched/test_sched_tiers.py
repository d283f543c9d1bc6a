"""The real SmolLM2 through the engine: greedy output must not depend on where the prefix came from.

Tier sizes are tiny so that other prompts push prompt A out of the GPU (and host); `cached_tokens` per
tier says which tier served A the second time. float32 on CPU keeps the tokens stable.
"""

from __future__ import annotations

import threading

import pytest
from sched_helpers import make_engine, run_all, settle_l3

from hicache.engine.params import SamplingParams
from hicache.engine.request import Status
from tiers import LaunchLater

PAGE = 8
A = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
     "movable metal type, oil-based ink and a wooden screw press. Within fifty years printers worked in")
OTHERS = [
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make "
    "glucose and oxygen. It happens mostly in the leaves, inside small structures called chloroplasts that",
    "A binary search tree keeps its keys in order: every key in the left subtree of a node is smaller than "
    "the node's key and every key in the right subtree is larger. Searching therefore takes time that",
    "Mount Kilimanjaro in Tanzania is the highest mountain in Africa. It is a dormant volcano with three "
    "cones, Kibo, Mawenzi and Shira, and climbers usually need five to eight days to reach the summit and",
    "Bread dough rises because yeast ferments the sugars in flour and releases carbon dioxide, which is "
    "trapped by the stretchy gluten network. Bakers knead the dough to develop that network, and then they",
    "The Pacific Ocean is the largest and deepest of the world's oceans, covering about a third of the "
    "surface of the Earth. Its deepest point, the Challenger Deep in the Mariana Trench, lies nearly eleven",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def generate(engine, prompts: list[str], params: SamplingParams = GREEDY) -> list:
    """(token ids, streamed text, final output) per prompt, in order."""
    ids = [f"{engine.counters['steps']}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, engine.tokenizer.encode(prompt), params)
    results = run_all(engine)
    return [results[request_id] for request_id in ids]


@pytest.fixture(scope="module")
def baseline(smollm):
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=4096)
    ids, _, out = generate(engine, [A])[0]
    assert len(engine.tokenizer.encode(A)) >= 4 * PAGE + 1
    assert out.usage.total_cached_tokens == 0
    return ids, engine


def served(smollm, baseline, expect_tier: str, **tiers) -> None:
    engine = make_engine(smollm, cache__page_size=PAGE, **tiers)
    first, _, _ = generate(engine, [A])[0]
    assert first == baseline[0]
    for other in OTHERS:
        generate(engine, [other])
        settle_l3(engine)
    ids, _, out = generate(engine, [A])[0]
    cached = out.usage.cached_tokens
    full = len(engine.tokenizer.encode(A)) // PAGE * PAGE
    if expect_tier == "none":
        assert cached == {"device": 0, "host": 0, "disk": 0}
    else:
        assert cached[expect_tier] == full and out.usage.total_cached_tokens == full, cached
    assert ids == baseline[0]
    if tiers.get("scheduler__launch_loads_after_forward") or tiers.get("scheduler__admit_during_forward"):
        # the loads were held, and each step launched them
        copier = engine.cache.controller.copier
        assert isinstance(copier, LaunchLater) and copier.launched_loads >= 1 and copier.held == 0
    engine.close()


def test_prefix_from_device(smollm, baseline):
    engine = baseline[1]
    ids, _, out = generate(engine, [A])[0]
    assert out.usage.cached_tokens["device"] == len(engine.tokenizer.encode(A)) // PAGE * PAGE
    assert ids == baseline[0]


LOAD_MODES = {  # how the engine starts page loads
    "loads-at-once": {"scheduler__launch_loads_after_forward": False, "scheduler__admit_during_forward": False},
    "loads-after-forward": {"scheduler__launch_loads_after_forward": True, "scheduler__admit_during_forward": False},
    "admit-during-forward": {"scheduler__launch_loads_after_forward": False, "scheduler__admit_during_forward": True},
}


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_prefix_from_host(smollm, baseline, mode):
    served(smollm, baseline, "host", cache__device__size_tokens=12 * PAGE, cache__host__size_tokens=4096,
           **LOAD_MODES[mode])


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_prefix_from_disk(smollm, baseline, tmp_path, mode):
    served(smollm, baseline, "disk", cache__device__size_tokens=12 * PAGE, cache__host__size_tokens=12 * PAGE,
           cache__l3__path=str(tmp_path / "l3"), cache__l3__size_gib=None, cache__l3__size_tokens=4096,
           **LOAD_MODES[mode])


def test_prefix_recomputed(smollm, baseline):
    served(smollm, baseline, "none", cache__device__size_tokens=12 * PAGE)


def test_batched_with_others(smollm, baseline):
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=4096, scheduler__chunk_tokens=96)
    results = generate(engine, [OTHERS[0], A, OTHERS[1], OTHERS[2]])
    assert results[1][0] == baseline[0]
    assert engine.stats()["engine"]["steps"] < 4 * 9  # prefill chunks and decodes were batched


def test_stop_string_trims_and_streams(smollm):
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=2048)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = engine.tokenizer.encode(prompt)
    engine.add_request("free", ids, SamplingParams(temperature=0.0, max_tokens=16))
    full = run_all(engine)["free"]
    assert "Paris" in full[1] and full[2].finish_reason == "stop"  # EOS
    engine.add_request("stopped", ids, SamplingParams(temperature=0.0, max_tokens=16, stop=("Paris", "London")))
    ids_out, text, out = run_all(engine)["stopped"]  # text = concatenated streamed deltas
    assert out.finish_reason == "stop"
    assert text == full[1][: full[1].index("Paris")]
    assert "Par" not in text[-3:]


def test_idle_engine_starts_deferred_host_copies(smollm, baseline):
    """With room on the GPU, write-through copies wait (cache.write_policy.defer_above_free); an idle step copies."""
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=4096,
                         cache__host__size_tokens=4096, cache__write_policy__defer_above_free=0.25)
    generate(engine, [A])
    ctrl = engine.cache.controller
    full = len(engine.tokenizer.encode(A)) // PAGE
    assert ctrl.host.used_pages() == 0 and ctrl.stats.deferred_pages >= full
    assert engine.step() == [] and not engine.has_unfinished()  # idle
    nodes = [n for n in ctrl.tree.nodes() if n.device_pages is not None]
    assert ctrl.host.used_pages() == sum(n.num_pages for n in nodes) >= full
    for node in nodes:  # the host copies hold the GPU pages' bytes (page-first vs layer-first layout)
        for dev_page, host_page in zip(node.device_pages, node.host_pages):
            assert ctrl.host.buffer[host_page].equal(ctrl.device.kv[:, :, dev_page])
    engine.close()


def test_write_through_at_commit_when_deferral_is_off(smollm, baseline):
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=4096,
                         cache__host__size_tokens=4096, cache__write_policy__defer_above_free=1.0)
    generate(engine, [A])
    assert engine.cache.controller.host.used_pages() >= len(engine.tokenizer.encode(A)) // PAGE
    assert engine.cache.controller.stats.deferred_pages == 0
    engine.close()


def test_held_loads_start_in_the_step_that_asks_for_them(smollm, baseline):
    """launch_loads_after_forward: A's host load, asked for while the step also prefills another prompt, starts
    right after that step's forward: no step ends with a load still held, and A's output is unchanged."""
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
                         cache__host__size_tokens=4096, scheduler__launch_loads_after_forward=True)
    generate(engine, [A])
    for other in OTHERS[1:]:
        generate(engine, [other])
    copier = engine.cache.controller.copier
    before = copier.launched_loads
    tok = engine.tokenizer
    engine.add_request("other", tok.encode(OTHERS[0]), GREEDY)
    engine.step()  # the other prompt is admitted and its prefill runs
    engine.add_request("a", tok.encode(A), GREEDY)
    results, steps_with_work = {}, 0
    while engine.has_unfinished():
        busy = bool(engine.scheduler.running)
        for out in engine.step():
            results[out.request_id] = results.get(out.request_id, []) + out.new_token_ids
            if out.finished:
                results[out.request_id + ".out"] = out
        assert copier.held == 0, "a step ended with a load still held"
        steps_with_work += busy
    assert copier.launched_loads > before and steps_with_work >= 2
    assert results["a.out"].usage.cached_tokens["host"] == len(tok.encode(A)) // PAGE * PAGE
    assert results["a"] == baseline[0]
    engine.close()


def test_admission_during_the_forward_starts_the_next_load_in_the_same_step(smollm, baseline):
    """admit_during_forward: A, queued behind another prompt's last prefill chunk, is admitted while that chunk's
    forward runs, and its host load is launched before the step returns (no step ends with a load held or the
    fence still pinned); without the setting A is still waiting when that step ends. A's output is unchanged."""
    waiting_after = {}
    for ahead in (False, True):
        engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
                             cache__host__size_tokens=4096, scheduler__chunk_tokens=2 * PAGE,
                             scheduler__admit_during_forward=ahead)
        generate(engine, [A])
        for other in OTHERS[1:]:
            generate(engine, [other])
        tok = engine.tokenizer
        copier = engine.cache.controller.copier
        other = tok.encode(OTHERS[0])
        assert 4 * PAGE < len(other) <= 6 * PAGE  # three chunks of 2 pages: the second step's forward leaves < 2
        engine.add_request("other", other, GREEDY)
        engine.add_request("a", tok.encode(A), GREEDY)  # the other prompt's backlog fills each step: A waits
        assert isinstance(copier, LaunchLater)  # the default, and implied by admit_during_forward
        results, steps = {}, 0
        while engine.has_unfinished():
            outputs = engine.step()
            steps += 1
            if steps == 2:  # admit_ahead saw a backlog under one chunk once the second chunk was in flight
                waiting_after[ahead] = engine.requests["a"].status is Status.WAITING
            for out in outputs:
                results[out.request_id] = results.get(out.request_id, []) + out.new_token_ids
                if out.finished:
                    results[out.request_id + ".out"] = out
            assert copier.held == 0 and copier._pinned is None
        assert results["a.out"].usage.cached_tokens["host"] == len(tok.encode(A)) // PAGE * PAGE
        assert results["a"] == baseline[0]
        engine.close()
    assert waiting_after == {False: True, True: False}


def test_close_after_a_failed_step_launches_the_held_loads(smollm, baseline):
    """A forward that raises after scheduling asked for A's load: the failed step still launches it on its way out,
    so close() drains A's ticket instead of waiting for it forever."""
    engine = make_engine(smollm, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
                         cache__host__size_tokens=4096, scheduler__launch_loads_after_forward=True)
    generate(engine, [A])
    for other in OTHERS[1:]:
        generate(engine, [other])
    tok = engine.tokenizer
    engine.add_request("other", tok.encode(OTHERS[0]), GREEDY)
    engine.step()
    engine.add_request("a", tok.encode(A), GREEDY)
    real_forward = engine._forward

    def failing_forward(plan):
        raise RuntimeError("device lost")

    engine._forward = failing_forward
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()
    engine._forward = real_forward
    copier = engine.cache.controller.copier
    assert copier.held == 0 and copier.launched_loads >= 1  # A's host load, asked for while scheduling the failed step
    assert engine.scheduler.loading or engine.scheduler.running
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "close() waited forever for a load that was never launched"
    assert engine.cache.controller.copier.held == 0 and not engine.scheduler.draining
