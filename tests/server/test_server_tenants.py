"""Tenants through `hicache serve --tenants FILE`: another tenant's exact prompt gets cached_tokens 0 and the same
answer, a salt is a namespace of its own, per-tenant counters are labelled by name only, and neither a key nor a
salt reaches /metrics or the log."""

from __future__ import annotations

import httpx
from server_helpers import metric, metrics, tiny_config

from hicache.replay.trace import read_trace

MODEL = "random:tiny"
PROMPT = ("the system prompt of a coding agent, long enough to span pages. " * 6)[:300]
SALT = "a-salt-only-alice-knows"


def complete(server, key: str, **extra):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    return r


def test_tenants_are_isolated_and_counted_by_name(start_server, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  alice: {keys: [key-alice], share: 0.5}\n  bob: {keys: [key-bob]}\n"
                       "  ops: {keys: [key-ops], shared: true}\n")
    trace = tmp_path / "trace.jsonl"
    server = start_server("--config", str(tiny_config(tmp_path)), "--tenants", str(tenants), "--trace-log", str(trace),
                          "--metrics-key", "key-metrics")
    first = complete(server, "key-alice").json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    again = complete(server, "key-alice").json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    for key, extra in (("key-bob", {}), ("key-ops", {}), ("key-alice", {"cache_salt": SALT})):
        other = complete(server, key, **extra).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (key, extra)
        assert other["choices"][0]["text"] == first["choices"][0]["text"]
    salted = complete(server, "key-alice", cache_salt=SALT).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same salt matches itself
    assert complete(server, "key-nobody").status_code == 401
    r = complete(server, "key-alice", cache_salt="")
    assert r.status_code == 400 and "cache_salt" in r.json()["error"]["message"]

    for headers in ({}, {"Authorization": "Bearer key-alice"}, {"Authorization": "Bearer"}):
        # without the metrics key, nothing says which tenant sent or hit what
        assert "hicache_tenant_" not in httpx.get(f"{server.url}/metrics", headers=headers, timeout=10).text
    values = metrics(server.url, headers={"Authorization": "Bearer key-metrics"})
    assert metric(values, "hicache_request_prompt_tokens_total") > 0  # the server's own series stay for everyone
    cached = {t: sum(metric(values, "hicache_tenant_cached_tokens_total", tenant=t, tier=tier)
                     for tier in ("device", "host", "disk", "remote")) for t in ("alice", "bob", "ops")}
    assert cached["alice"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] + \
        salted["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached["bob"] == cached["ops"] == 0
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert metric(values, "hicache_tenant_prompt_tokens_total", tenant="alice") == 4 * prompt_tokens
    assert metric(values, "hicache_tenant_cache_pages", tenant="alice", tier="device") > 0
    assert metric(values, "hicache_tenant_cache_pages", tenant="bob", tier="device") > 0
    text = httpx.get(f"{server.url}/metrics", timeout=10).text + server.log()
    for secret in ("key-alice", "key-bob", SALT):
        assert secret not in text
    assert server.stop() == 0
    # the trace log hashes each namespace's pages apart: a replay of it finds no hit between tenants either
    records = read_trace(trace, strict=True).records
    hashes = [tuple(r.hash_ids) for r in records]
    assert len(records) == 6 and hashes[0] == hashes[1] and hashes[4] == hashes[5]  # alice twice, her salt twice
    assert len({hashes[0], hashes[2], hashes[3], hashes[4]}) == 4  # alice, bob, ops (shared), alice's salt
    assert all(secret not in trace.read_text() for secret in ("key-alice", SALT))


def test_a_bad_tenants_file_stops_the_server_before_the_model_loads(start_server, tmp_path):
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  alice: {keys: [k], share: 2}\n")
    server = start_server("--config", str(tiny_config(tmp_path)), "--tenants", str(tenants), ready=False)
    assert server.proc.wait(60) != 0
    assert "tenant 'alice': 'share' must be a number in (0, 1]" in server.log()
