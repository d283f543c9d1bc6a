"""The OpenAI API through the official client: chat and completions, streaming or not, cached tokens, metrics."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from server_helpers import metric, metrics

MODEL = "random:tiny"
REQUIRED_FAMILIES = (
    'hicache_cache_hit_tokens_total{tier="device"}', 'hicache_cache_hit_tokens_total{tier="host"}',
    'hicache_cache_hit_tokens_total{tier="disk"}', "hicache_prompt_tokens_total",
)


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def words(seed: int, n: int) -> str:
    """A distinct text of about n characters (n tokens for the byte-level tokenizer of random models)."""
    base = f"conversation {seed} says hello to the cache, then keeps talking about pages and tiers. "
    return (base * (n // len(base) + 1))[:n]


def test_models_and_health(server, client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_chat_completion(client) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi there"}],
                                       max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 5
    assert r.usage.prompt_tokens > len("Hi there")  # the chat template wraps the message


def test_chat_stream_matches_non_stream(client) -> None:
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about caches"}], max_tokens=12,
                temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_and_stream(client) -> None:
    prompt = words(1, 100)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.object == "text_completion" and full.usage.prompt_tokens == 100
    assert full.usage.completion_tokens == 10
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.prompt_tokens == 100


def test_completion_token_ids_and_stop(client) -> None:
    r = client.completions.create(model=MODEL, prompt=[72, 105, 33, 32], max_tokens=3, temperature=0)
    assert r.usage.prompt_tokens == 4
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, temperature=0, stop=["\x00"])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_cached_tokens_rise_on_repeated_prefix(server, client) -> None:
    before = metrics(server.url)
    prompt = words(2, 300)
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=MODEL, prompt=prompt + " and more", max_tokens=4, temperature=0)
    details = second.usage.prompt_tokens_details
    assert details.cached_tokens == 288  # the 18 full pages of the first prompt (16 tokens per page)
    assert details.cached_tokens_per_tier == {"device": 288, "host": 0, "disk": 0, "remote": 0}  # hicache's extension
    after = metrics(server.url)
    hits = metric(after, "hicache_cache_hit_tokens_total", tier="device") - metric(
        before, "hicache_cache_hit_tokens_total", tier="device")
    assert hits >= 288
    assert metric(after, "hicache_prompt_tokens_total") - metric(before, "hicache_prompt_tokens_total") >= 609


def test_metrics_exposition(server, client) -> None:
    client.completions.create(model=MODEL, prompt=words(3, 40), max_tokens=2)
    values = metrics(server.url)
    for tier in ("device", "host", "disk"):
        for name in ("hicache_cache_hit_tokens_total", "hicache_evictions_total", "hicache_tier_used_pages",
                     "hicache_tier_capacity_pages", "hicache_tier_capacity_bytes"):
            assert (name, (("tier", tier),)) in values, (name, tier)
    assert metric(values, "hicache_tier_capacity_pages", tier="device") == 4096 // 16
    assert metric(values, "hicache_tier_capacity_pages", tier="disk") == 32768 // 16
    # the GPU -> host copies of a write-through that defers them start once the engine is idle, after the answer:
    # wait for them rather than for a moment
    deadline = time.monotonic() + 30
    while metric(values, "hicache_pages_demoted_total", src="device", dst="host") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        values = metrics(server.url)
    assert metric(values, "hicache_pages_demoted_total", src="device", dst="host") > 0
    assert metric(values, "hicache_bytes_moved_total", src="device", dst="host") > 0
    assert ("hicache_pages_promoted_total", (("dst", "device"), ("src", "host"))) in values
    assert metric(values, "hicache_l3_state", state="ok") == 1
    assert metric(values, "hicache_l3_io_backend", backend="buffered") == 1
    assert ("hicache_queue_depth", ()) in values
    assert metric(values, "hicache_engine_steps_total") > 0
    assert metric(values, "hicache_engine_graph_steps_total") == 0  # CPU: no CUDA graphs
    assert metric(values, "hicache_engine_forward_seconds_total") > 0
    assert metric(values, "hicache_engine_schedule_seconds_total") > 0
    overlapped = metric(values, "hicache_engine_schedule_overlapped_seconds_total")  # launching held loads
    assert 0 < overlapped <= metric(values, "hicache_engine_schedule_seconds_total")
    assert metric(values, "hicache_time_to_first_token_seconds_count") >= 1
    assert metric(values, "hicache_requests_total", finish_reason="length") >= 1
    # garbage collection: startup's objects frozen out of it (thousands: modules, model, app), collections timed
    assert metric(values, "hicache_gc_frozen_objects") > 10_000
    assert metric(values, "hicache_gc_collections_total", generation="0") > 0
    assert 0 < metric(values, "hicache_gc_longest_pause_seconds") <= metric(values, "hicache_gc_seconds_total")


def test_32_concurrent_clients(server) -> None:
    async def main() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120) as c:
            calls = []
            for i in range(32):
                if i % 2:
                    calls.append(c.chat.completions.create(
                        model=MODEL, messages=[{"role": "user", "content": words(100 + i % 4, 120)}], max_tokens=6,
                        temperature=0.7, seed=i, extra_body={"ignore_eos": True}))
                else:
                    calls.append(c.completions.create(model=MODEL, prompt=words(200 + i, 80), max_tokens=6,
                                                      stream=False, extra_body={"ignore_eos": True}))
            return await asyncio.wait_for(asyncio.gather(*calls), timeout=120)

    results = asyncio.run(main())
    assert len({r.id for r in results}) == 32
    assert all(r.usage.completion_tokens == 6 for r in results)
    chat = [r for r in results if r.object == "chat.completion"]
    assert sum(r.usage.prompt_tokens_details.cached_tokens > 0 for r in chat) >= 1  # 4 prompts, 16 requests
