"""Greedy output must not depend on where the prefix came from: device, host, disk or recomputed.

The tier logic runs on random:tiny (2 layers, seeded random weights, a byte tokenizer: one token per byte) with its
weights sharpened (`sharp`), float32 on CPU; one end-to-end test runs the real SmolLM2 (30 layers) through the same
path. Tier sizes are tiny so that other prompts push prompt A out of the GPU (and host); `cached_tokens` per tier
says which tier served A the second time.

Random weights make two demands the real model did not: A's greedy tokens must win by a margin far above float32
rounding (the cached and recomputed paths round differently; the `baseline` fixture checks the margin), and a wrong
prefix page must change them, or comparing them would prove nothing (test_a_wrong_prefix_page_changes_the_output).
"""

from __future__ import annotations

import threading

import pytest
import torch
from sched_helpers import assert_no_leaks, make_engine, run_all, settle_l3

from hicache.engine.model import ForwardBatch
from hicache.engine.params import SamplingParams
from hicache.engine.request import Status
from hicache.engine.weights import load_model
from tiers import LaunchLater

PAGE = 8
REAL_A = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
          "movable metal type, oil-based ink and a wooden screw press. Within fifty years printers worked in")
REAL_OTHERS = [
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
# random:tiny: the same texts cut to SmolLM2's token counts of them (36; 36, 44, 47, 41, 43), so the page counts the
# tests rely on stay as they were; A is 42 bytes (5 pages + 2)
A = REAL_A[:42]
OTHERS = [text[:n] for text, n in zip(REAL_OTHERS, (36, 44, 47, 41, 43))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
# random:tiny's weights have std 0.02: its attention is near uniform, a token's output hangs on the mean of its keys,
# and one wrong page of A's five left the greedy tokens unchanged in 9 of 25 tries (a stale last page on a host load
# went unnoticed where SmolLM2 failed). Four times the weights peak the attention: 25 of 25 change.
SHARPEN = 4.0
# float32 rounding moves sharp's logits (|logit| < 3) by ~1e-6 between the cached and recomputed paths; A's greedy
# tokens win by > 1e-2
MIN_GREEDY_MARGIN = 1e-4
POOL_PAGES = 16


@pytest.fixture(scope="module")
def sharp():
    """random:tiny with every weight matrix times SHARPEN (a copy of its own: the session's `tiny` stays as is)."""
    model, tokenizer = load_model("random:tiny", torch.float32, torch.device("cpu"))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.mul_(SHARPEN)
    return model, tokenizer


def generate(engine, prompts: list[str], params: SamplingParams = GREEDY) -> list:
    """(token ids, streamed text, final output) per prompt, in order."""
    ids = [f"{engine.counters['steps']}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, engine.tokenizer.encode(prompt), params)
    results = run_all(engine)
    return [results[request_id] for request_id in ids]


def forward(model, kv: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
    """The model straight on one sequence (its page i in pool page i): last-token logits of tokens[start:], whose
    KV goes into `kv` after that of tokens[:start], already there."""
    n = len(tokens)
    positions = torch.arange(start, n)
    batch = ForwardBatch(torch.tensor(tokens[start:]), positions, positions, [n], [n - start],
                         [torch.arange(-(-n // PAGE))])
    with torch.no_grad():
        return model(batch, kv, PAGE)


def greedy(model, kv: torch.Tensor, tokens: list[int], start: int, steps: int) -> tuple[list[int], list[float]]:
    """`steps` greedy tokens after `tokens` (those before `start` already in `kv`), and by how much each won."""
    tokens, ids, margins = list(tokens), [], []
    for _ in range(steps):
        top = forward(model, kv, tokens, start)[-1].topk(2)
        margins.append(float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
        start = len(tokens)
        tokens.append(ids[-1])
    return ids, margins


def empty_pool(model) -> torch.Tensor:
    return torch.zeros(model.kv_pool_shape(POOL_PAGES, PAGE))


def no_cache_baseline(model_pair, prompt: str):
    engine = make_engine(model_pair, cache__page_size=PAGE, cache__device__size_tokens=4096)
    ids, _, out = generate(engine, [prompt])[0]
    assert len(engine.tokenizer.encode(prompt)) >= 4 * PAGE + 1
    assert out.usage.total_cached_tokens == 0
    return ids, engine


@pytest.fixture(scope="module")
def baseline(sharp):
    ids, engine = no_cache_baseline(sharp, A)
    direct, margins = greedy(sharp[0], empty_pool(sharp[0]), engine.tokenizer.encode(A), 0, len(ids))
    assert direct == ids  # the engine's tokens are the model's
    assert min(margins) > MIN_GREEDY_MARGIN, f"A's greedy tokens are near ties {margins}: pick another A"
    yield ids, engine
    engine.close()


def served(model_pair, baseline, expect_tier: str, a: str = A, others: list[str] = OTHERS, **tiers) -> None:
    engine = make_engine(model_pair, cache__page_size=PAGE, **tiers)
    first, _, _ = generate(engine, [a])[0]
    assert first == baseline[0]
    for other in others:
        generate(engine, [other])
        settle_l3(engine)
    ids, _, out = generate(engine, [a])[0]
    cached = out.usage.cached_tokens
    full = len(engine.tokenizer.encode(a)) // PAGE * PAGE
    if expect_tier == "none":
        assert cached == {"device": 0, "host": 0, "disk": 0, "remote": 0}
    else:
        assert cached[expect_tier] == full and out.usage.total_cached_tokens == full, cached
    assert ids == baseline[0]
    if tiers.get("scheduler__launch_loads_after_forward") or tiers.get("scheduler__admit_during_forward"):
        # the loads were held, and each step launched them
        copier = engine.cache.controller.copier
        assert isinstance(copier, LaunchLater) and copier.launched_loads >= 1 and copier.held == 0
    engine.close()


def test_a_wrong_prefix_page_changes_the_output(sharp, baseline):
    """What a tier that served a wrong page would do: A's KV with one full page replaced by another prompt's KV for
    the same positions (each page, each other prompt), the rest of A and the greedy tokens computed over it. None
    gives A's tokens, so the tier tests' equal outputs do catch a wrong page; A's own pages do give them."""
    model, tokenizer = sharp
    a = tokenizer.encode(A)
    cached = len(a) // PAGE * PAGE
    kv_a = empty_pool(model)
    forward(model, kv_a, a[:cached], 0)
    assert greedy(model, kv_a.clone(), a, cached, len(baseline[0]))[0] == baseline[0]
    for other in REAL_OTHERS:  # long enough to fill A's full pages
        kv_other = empty_pool(model)
        forward(model, kv_other, tokenizer.encode(other)[:cached], 0)
        for page in range(cached // PAGE):
            kv = kv_a.clone()
            kv[:, :, page] = kv_other[:, :, page]  # [layers, k/v, pages, ...]
            assert greedy(model, kv, a, cached, len(baseline[0]))[0] != baseline[0], (other[:20], page)


def test_prefix_from_device(sharp, baseline):
    engine = baseline[1]
    ids, _, out = generate(engine, [A])[0]
    assert out.usage.cached_tokens["device"] == len(engine.tokenizer.encode(A)) // PAGE * PAGE
    assert ids == baseline[0]


LOAD_MODES = {  # how the engine starts page loads
    "loads-at-once": {"scheduler__launch_loads_after_forward": False, "scheduler__admit_during_forward": False},
    "loads-after-forward": {"scheduler__launch_loads_after_forward": True, "scheduler__admit_during_forward": False},
    "admit-during-forward": {"scheduler__launch_loads_after_forward": False, "scheduler__admit_during_forward": True},
}
HOST_TIERS = {"cache__device__size_tokens": 12 * PAGE, "cache__host__size_tokens": 4096}


def disk_tiers(tmp_path) -> dict:
    return {"cache__device__size_tokens": 12 * PAGE, "cache__host__size_tokens": 12 * PAGE,
            "cache__l3__path": str(tmp_path / "l3"), "cache__l3__size_gib": None, "cache__l3__size_tokens": 4096}


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_prefix_from_host(sharp, baseline, mode):
    served(sharp, baseline, "host", **HOST_TIERS, **LOAD_MODES[mode])


@pytest.mark.parametrize("mode", LOAD_MODES)
def test_prefix_from_disk(sharp, baseline, tmp_path, mode):
    served(sharp, baseline, "disk", **disk_tiers(tmp_path), **LOAD_MODES[mode])


def test_prefix_from_disk_through_the_l3_process(sharp, baseline, tmp_path):
    """The store in a process of its own (cache.l3.worker: process), the host pool shared with it: same tokens."""
    served(sharp, baseline, "disk", **disk_tiers(tmp_path), cache__l3__worker="process",
           **LOAD_MODES["loads-after-forward"])


def _shared_tiers(url: str, prefix: str, **more) -> dict:
    return {"cache__device__size_tokens": 12 * PAGE, "cache__host__size_tokens": 12 * PAGE,
            "cache__remote__url": url, "cache__remote__key_prefix": prefix, "cache__remote__size_tokens": 4096,
            "cache__write_policy__defer_above_free": 1.0, "cache__write_policy__host_to_disk": "write_through",
            **more}


@pytest.mark.parametrize("local_l3", [False, True])
def test_a_prefix_computed_on_one_server_is_a_shared_hit_on_another(sharp, baseline, valkey, tmp_path, local_l3):
    """Two servers, one Valkey: A's prefix, computed by the first, is read from the remote tier by the second (an
    empty GPU, host and local disk) and gives the same greedy tokens."""
    prefix = f"share-{tmp_path.name}"
    more = lambda name: ({"cache__l3__path": str(tmp_path / name), "cache__l3__size_gib": None,  # noqa: E731
                          "cache__l3__size_tokens": 4096} if local_l3 else {})
    first = make_engine(sharp, cache__page_size=PAGE, **_shared_tiers(valkey.url, prefix, **more("a")))
    calibration = first.cache.l3.stats()["remote"]["writes"]  # the bandwidth calibration's pages, deleted since
    assert generate(first, [A])[0][0] == baseline[0]
    settle_l3(first)
    written = first.cache.l3.stats()["remote"]["writes"] - calibration
    first.close()
    full = len(first.tokenizer.encode(A)) // PAGE * PAGE
    assert written >= full // PAGE  # the prompt's full pages, and those the answer filled
    second = make_engine(sharp, cache__page_size=PAGE, **_shared_tiers(valkey.url, prefix, **more("b")))
    calibration = second.cache.l3.stats()["remote"]["hits"]
    ids, _, out = generate(second, [A])[0]
    assert out.usage.cached_tokens["remote"] == full and out.usage.cached_tokens["disk"] == 0
    assert ids == baseline[0]
    remote = second.cache.l3.stats()["remote"]
    assert remote["hits"] - calibration == full // PAGE and remote["bad_values"] == 0
    second.close()


def test_a_shared_tier_that_is_down_serves_by_recomputing(sharp, baseline):
    from hicache.valkey_local import free_port

    engine = make_engine(sharp, cache__page_size=PAGE,
                         **_shared_tiers(f"redis://127.0.0.1:{free_port()}/0", "down", cache__remote__timeout_s=0.5))
    assert engine.cache.l3.stats()["remote"]["state"] == "down"
    for _ in range(2):
        ids, _, out = generate(engine, [A])[0]
        assert ids == baseline[0]
    engine.close()


def test_a_shared_tier_killed_mid_run_leaves_every_request_served(sharp, baseline):
    """The pages of A are on the remote tier only (pushed out of GPU and host) when the server dies: A's next
    request finds them in the tree, its read fails within the timeout, and it is recomputed, with A's tokens."""
    from hicache.valkey_local import LocalServer

    with LocalServer() as server:
        engine = make_engine(sharp, cache__page_size=PAGE,
                             **_shared_tiers(server.url, "killed", cache__remote__timeout_s=0.5))
        assert generate(engine, [A])[0][0] == baseline[0]
        for other in OTHERS:
            generate(engine, [other])
            settle_l3(engine)
        server.stop()
        ids, _, out = generate(engine, [A])[0]
        assert ids == baseline[0] and out.usage.total_cached_tokens == 0
        stats = engine.cache.l3.stats()["remote"]
        assert stats["state"] == "down" and engine.cache.controller.stats.load_failures >= 1
        assert generate(engine, [OTHERS[0]])[0][0]  # and the server goes on
        engine.close()


def test_prefix_recomputed(sharp, baseline):
    served(sharp, baseline, "none", cache__device__size_tokens=12 * PAGE)


def test_real_weights_prefix_from_disk_equals_no_cache(smollm, tmp_path):
    """End to end on the real SmolLM2 (the default load mode): A's prefix written down to disk, pushed out of the GPU
    and host by other prompts and loaded back gives the tokens of a run with no cache."""
    ids, engine = no_cache_baseline(smollm, REAL_A)
    engine.close()
    served(smollm, (ids,), "disk", a=REAL_A, others=REAL_OTHERS, **disk_tiers(tmp_path),
           **LOAD_MODES["loads-after-forward"])


def test_batched_with_others(sharp, baseline):
    engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=4096, scheduler__chunk_tokens=96)
    results = generate(engine, [OTHERS[0], A, OTHERS[1], OTHERS[2]])
    assert results[1][0] == baseline[0]
    assert engine.stats()["engine"]["steps"] < 4 * 9  # prefill chunks and decodes were batched


# the plain random:tiny's greedy answers (> 1e-3 margins; no prefix is compared here): bytes, some of them lone
# halves of UTF-8 characters (U+FFFD) or ids past the byte vocabulary (no text); the chat ends with <|im_end|> after
# 7 tokens, the question runs to 16
EOS_PROMPT = "go other first its"
QUESTION = "Name the capital of Mongolia."  # answered "C\ufffdp\ufffd7p8H": "p" is a partial stop string, let go


def test_stop_string_trims_and_streams(tiny):
    engine = make_engine(tiny, cache__page_size=PAGE, cache__device__size_tokens=2048)
    engine.add_request("eos", engine.tokenizer.encode(EOS_PROMPT), SamplingParams(temperature=0.0, max_tokens=16))
    eos = run_all(engine)["eos"]
    assert eos[2].finish_reason == "stop" and len(eos[0]) < 16 and eos[0][-1] in engine.tokenizer.eos_token_ids
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    ids = engine.tokenizer.encode(prompt)
    engine.add_request("free", ids, SamplingParams(temperature=0.0, max_tokens=16))
    full = run_all(engine)["free"]
    assert "p8H" in full[1] and full[1].index("p") < full[1].index("p8H")  # a partial match comes first
    assert full[2].finish_reason == "length"  # no EOS: "stop" below is the stop string's
    engine.add_request("stopped", ids, SamplingParams(temperature=0.0, max_tokens=16, stop=("p8H", "London")))
    ids_out, text, out = run_all(engine)["stopped"]  # text = concatenated streamed deltas
    assert out.finish_reason == "stop"
    assert text == full[1][: full[1].index("p8H")]
    assert not text.endswith(("p", "p8"))
    engine.close()


def test_idle_engine_starts_deferred_host_copies(sharp, baseline):
    """With room on the GPU, write-through copies wait (cache.write_policy.defer_above_free); an idle step copies."""
    engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=4096,
                         cache__host__size_tokens=4096, cache__write_policy__defer_above_free=0.25)
    generate(engine, [A])
    ctrl = engine.cache.controller
    full = len(engine.tokenizer.encode(A)) // PAGE
    assert ctrl.host.used_pages() == 0 and ctrl.stats.deferred_pages >= full
    assert engine.step() == [] and not engine.has_unfinished()  # idle
    nodes = [n for n in ctrl.tree.nodes() if n.on_device]
    assert ctrl.host.used_pages() == sum(n.num_pages for n in nodes) >= full
    for node in nodes:  # the host copies hold the GPU pages' bytes (page-first vs layer-first layout)
        for dev_page, host_page in zip(node.device_pages, node.host_pages):
            assert ctrl.host.buffer[host_page].equal(ctrl.device.kv[:, :, dev_page])
    engine.close()


def test_write_through_at_commit_when_deferral_is_off(sharp, baseline):
    engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=4096,
                         cache__host__size_tokens=4096, cache__write_policy__defer_above_free=1.0)
    generate(engine, [A])
    assert engine.cache.controller.host.used_pages() >= len(engine.tokenizer.encode(A)) // PAGE
    assert engine.cache.controller.stats.deferred_pages == 0
    engine.close()


def test_held_loads_start_in_the_step_that_asks_for_them(sharp, baseline):
    """launch_loads_after_forward: A's host load, asked for while the step also prefills another prompt, starts
    right after that step's forward: no step ends with a load still held, and A's output is unchanged."""
    engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
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


def test_admission_during_the_forward_starts_the_next_load_in_the_same_step(sharp, baseline):
    """admit_during_forward: A, queued behind another prompt's last prefill chunk, is admitted while that chunk's
    forward runs, and its host load is launched before the step returns (no step ends with a load held or the
    fence still pinned); without the setting A is still waiting when that step ends. A's output is unchanged."""
    waiting_after = {}
    for ahead in (False, True):
        engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
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


def test_a_failed_step_ends_its_requests_and_launches_the_held_loads(sharp, baseline):
    """A forward that raises after scheduling: the requests of that step end with an error output, the loads the
    step asked for (A's, from host) still launch on its way out, and the engine goes on: A completes as without the
    failure, and close() drains cleanly."""
    engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
                         cache__host__size_tokens=4096, scheduler__launch_loads_after_forward=True)
    generate(engine, [A])
    for other in OTHERS[1:]:
        generate(engine, [other])
    tok = engine.tokenizer
    engine.add_request("other", tok.encode(OTHERS[0]), GREEDY)
    engine.step()
    engine.add_request("a", tok.encode(A), GREEDY)
    real_forward = engine._forward

    def failing_forward(plan, waits):
        raise RuntimeError("device lost")

    engine._forward = failing_forward
    failed = engine.step()
    engine._forward = real_forward
    assert [(o.request_id, o.finish_reason) for o in failed] == [("other", "error")]
    assert "device lost" in failed[0].error and "other" not in engine.requests
    copier = engine.cache.controller.copier
    assert copier.held == 0 and copier.launched_loads >= 1  # A's host load, asked for while scheduling the failed step
    ids, _, out = run_all(engine)["a"]
    assert ids == baseline[0] and out.finish_reason == "length"
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()
    closer.join(timeout=30)
    assert not closer.is_alive(), "close() waited forever"
    assert engine.cache.controller.copier.held == 0 and not engine.scheduler.draining


@pytest.mark.parametrize("stage", [True, False])
def test_a_queued_prefix_is_staged_on_the_gpu_behind_a_running_request(sharp, baseline, stage):
    """A, on host only, queues behind a long request whose pages leave too few for A's: A's first pages are copied
    into the free ones while it waits (cache.load_policy.stage), the rest at admission. Its hits stay host hits, its
    output is unchanged, and nothing is left locked; with staging off nothing is copied before admission."""
    engine = make_engine(sharp, cache__page_size=PAGE, cache__device__size_tokens=16 * PAGE,
                         cache__host__size_tokens=4096, cache__load_policy__mode="always",
                         cache__load_policy__stage=stage)
    tok = engine.tokenizer
    generate(engine, [A])
    for other in OTHERS[1:4]:
        generate(engine, [other])  # A's pages leave the GPU; their host copies stay
    ctrl = engine.cache.controller
    a = tok.encode(A)
    full = len(a) // PAGE
    assert ctrl.match(a, reference=False).segments[0][1] == "host"
    long = tok.encode((OTHERS[0] * 2)[: 8 * PAGE])
    engine.add_request("long", long, SamplingParams(temperature=0.0, max_tokens=3 * PAGE, ignore_eos=True))
    engine.step()  # admitted: it needs 11 of the 16 pages until it ends (8 of prompt, 3 of answer)
    engine.add_request("a", a, GREEDY)  # needs 7 pages: it waits, with 5 free
    engine.step()
    queued = engine.requests["a"]
    assert queued.status is Status.WAITING
    assert (queued.stage_pages, ctrl.stats.staged_pages) == ((5, 5) if stage else (0, 0))
    if stage:
        assert ctrl.match(a, reference=False).segments[0][1] == "device"
    results = run_all(engine)
    assert results["a"][0] == baseline[0]
    assert results["a"][2].usage.cached_tokens["host"] == full * PAGE
    assert results["a"][2].usage.cached_tokens["device"] == 0
    assert ctrl.stats.staged_pages == (5 if stage else 0)
    assert_no_leaks(engine)
    engine.close()
