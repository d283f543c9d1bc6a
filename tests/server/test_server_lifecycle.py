"""Drain on SIGTERM, L3 pages found again after a restart, the trace log, cancel on client disconnect."""

from __future__ import annotations

import json
import threading

import httpx
import openai
from server_helpers import metric, metrics, tiny_config, wait_for

from hicache.replay.trace import read_trace

MODEL = "random:tiny"


def running(url: str) -> float:
    return metric(metrics(url), "hicache_num_requests", state="running")


def test_sigterm_drains_then_restart_hits_disk(tmp_path, start_server) -> None:
    config = tiny_config(tmp_path)
    trace = tmp_path / "trace.jsonl"
    first = start_server("--config", str(config), "--trace-log", str(trace))
    client = openai.OpenAI(base_url=f"{first.url}/v1", api_key="x", max_retries=0, timeout=60)
    prompt = ("a long shared system prompt about three tiers of KV cache. " * 9)[:480]  # 480 tokens, 30 pages
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 480 and r.usage.prompt_tokens_details.cached_tokens == 0
    # sent again, the prefix is reused, so it goes to the L3 (cache.write_policy.l3_admit: reuse); once is not enough
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 464  # the last token is always computed

    # a long streamed request is in flight when SIGTERM arrives: it still runs to the end
    received: list[str] = []
    finish: list[str | None] = []

    def stream() -> None:
        for chunk in client.completions.create(model=MODEL, prompt="drain me", max_tokens=400, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True}):
            received.append(chunk.choices[0].text)
            finish.append(chunk.choices[0].finish_reason)

    thread = threading.Thread(target=stream)
    thread.start()
    assert wait_for(lambda: len(received) >= 3, timeout=30)
    assert first.stop(timeout=90) == 0
    thread.join(30)
    assert finish[-1] == "length"
    assert "shutting down the engine" in first.log()
    assert "nanobind" not in first.log()  # a clean shutdown prints no teardown noise that reads as a crash

    records = read_trace(trace, strict=True).records
    assert [rec.input_length for rec in records] == [480, 480, 8]
    assert len(records[0].hash_ids) == 30 and records[2].output_length == 400
    assert records[0].ttft_ms is not None and records[0].cached_tokens == {"device": 0, "host": 0, "disk": 0}
    assert json.loads(trace.read_text().splitlines()[0])["block_tokens"] == 16

    second = start_server("--config", str(config))
    client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model=MODEL, prompt=prompt + "and a new question", max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens_details.cached_tokens == 480
    assert r.usage.prompt_tokens_details.cached_tokens_per_tier == {"device": 0, "host": 0, "disk": 480, "remote": 0}
    values = metrics(second.url)
    assert metric(values, "hicache_cache_hit_tokens_total", tier="disk") == 480
    assert metric(values, "hicache_pages_promoted_total", src="disk", dst="host") == 30


def test_stream_disconnect_aborts(server) -> None:
    before = metric(metrics(server.url), "hicache_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "talk forever", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # the connection is closed: the server aborts the request long before its 2000 tokens
    assert wait_for(lambda: metric(metrics(server.url), "hicache_requests_total", finish_reason="abort") > before)
    assert wait_for(lambda: running(server.url) == 0)


def test_non_stream_disconnect_aborts(server) -> None:
    before = metric(metrics(server.url), "hicache_requests_total", finish_reason="abort")
    body = {"model": MODEL, "prompt": "talk forever too", "max_tokens": 2000, "ignore_eos": True}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    except httpx.ReadTimeout:
        pass  # the client gives up and closes the connection
    assert wait_for(lambda: metric(metrics(server.url), "hicache_requests_total", finish_reason="abort") > before)
    assert wait_for(lambda: running(server.url) == 0)
    # nothing is left locked or running: the next request runs to its end
    r = httpx.post(f"{server.url}/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": "after", "max_tokens": 500, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 500


def test_a_request_cut_off_by_the_drain_timeout_gets_a_503(tmp_path, start_server) -> None:
    # no drain time at all: the request, running when SIGTERM comes, is cut off whatever the speed of the machine
    server = start_server("--config", str(tiny_config(tmp_path)), "--no-l3", "--drain-timeout", "0")
    answers: list[httpx.Response] = []
    body = {"model": MODEL, "prompt": "talk for long", "max_tokens": 1900, "ignore_eos": True}

    def ask() -> None:
        answers.append(httpx.post(f"{server.url}/v1/completions", json=body, timeout=60))

    thread = threading.Thread(target=ask)
    thread.start()
    assert wait_for(lambda: running(server.url) == 1, timeout=30)
    server.stop(timeout=60)
    thread.join(60)
    r = answers[0]
    assert r.status_code == 503, r.text
    assert r.json()["error"]["type"] == "server_error" and "drain timeout" in r.json()["error"]["message"]
    log = server.log()
    assert "answered 503" in log and "CancelledError" not in log and "Traceback" not in log
