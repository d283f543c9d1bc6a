"""`hicache bench agent` and `agent-gen`: trace parsing, token-id prompts, the generator, runs against a real server."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from server_helpers import tiny_config

from hicache.bench_client.agent import AgentOptions, run_agent
from hicache.bench_client.workload import (
    GenParams,
    PromptBuilder,
    describe,
    load_traces,
    read_agent_json,
    synthesize,
    write_sessions,
)
from hicache.cli import main
from hicache.replay.trace import TraceError

SAMPLES = Path(__file__).resolve().parents[3] / "shared" / "traces" / "agent"


def req(t: float, n_in: int, ids: list[int], out: int = 20, **extra) -> dict:
    return {"t": t, "type": "n", "in": n_in, "out": out, "hash_ids": ids, **extra}


def write(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def agent_trace(tmp_path: Path) -> Path:
    """A parent of 3 requests with two sub-agents between its 2nd and 3rd; the first sub-agent resends the
    parent's first two blocks (one scope per file)."""
    subs = [
        {"t": 5.0, "type": "subagent", "agent_id": "explore",
         "requests": [req(0.0, 200, [1, 2, 50], think_time=0.0), req(3.0, 260, [1, 2, 50, 51], think_time=1.0)]},
        {"t": 5.0, "type": "subagent", "agent_id": "plan", "requests": [req(0.0, 130, [60, 61])]},
    ]
    requests = [req(0.0, 150, [1, 2], think_time=0.0), req(4.0, 200, [1, 2, 3], think_time=2.5), *subs,
                req(20.0, 330, [1, 2, 3, 4, 5], api_time=1.5)]  # no think_time: 20 - 4 - 0 (no api_time at 4.0)
    return write(tmp_path / "parent.json", {"id": "parent", "block_size": 64, "hash_id_scope": "local",
                                            "requests": requests})


def mooncake_trace(tmp_path: Path) -> Path:
    lines = [{"timestamp": 1000, "input_length": 10240, "output_length": 4, "hash_ids": list(range(20))},
             {"timestamp": 3500, "input_length": 12700, "output_length": 40, "hash_ids": list(range(25))},
             {"timestamp": 4000, "input_length": 600, "output_length": 1, "hash_ids": [90, 91]}]
    path = tmp_path / "mooncake.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def test_parse_agent_sessions_and_subagents(tmp_path) -> None:
    (parent,) = load_traces([agent_trace(tmp_path)])
    assert parent.name == "parent" and parent.scope == "parent" and parent.block_size == 64
    assert parent.arrival is None
    first, second, group, third = parent.steps
    assert [r.index for r in parent.requests()] == [0, 1, 2]
    assert (second.input_length, second.output_length, second.hash_ids, second.think_time) == (200, 20, [1, 2, 3], 2.5)
    assert third.think_time == 16.0  # not recorded: the gap since the previous request
    assert [s.name for s in group] == ["parent/sa1-explore", "parent/sa2-plan"]
    assert {s.scope for s in group} == {"parent"}  # hash_id_scope local: one scope per file, shared with sub-agents
    assert [r.hash_ids for r in group[0].requests()] == [[1, 2, 50], [1, 2, 50, 51]]
    assert [s.name for s in parent.walk()] == ["parent", "parent/sa1-explore", "parent/sa2-plan"]
    # a second file with the same id and the same hash ids is another scope; "global" files share one
    (tmp_path / "other").mkdir()
    write(tmp_path / "other" / "a.json", {"id": "parent", "requests": [req(0.0, 64, [1])]})
    write(tmp_path / "other" / "b.json", {"id": "g", "hash_id_scope": "global", "requests": [req(0.0, 64, [1])]})
    sessions = load_traces([tmp_path / "parent.json", tmp_path / "other"])
    assert [s.scope for s in sessions] == ["parent", "parent+", "global"]
    with pytest.raises(TraceError, match="hash_ids"):
        load_traces([write(tmp_path / "bad.json", {"requests": [req(0.0, 64, [1, 2, 3])]})])


def test_parse_mooncake(tmp_path) -> None:
    sessions = load_traces([mooncake_trace(tmp_path)])
    assert [s.arrival for s in sessions] == [0.0, 2.5, 3.0]  # seconds from the first request
    assert {s.scope for s in sessions} == {"mooncake:mooncake.jsonl"}  # ids are global across the file
    assert [len(s.steps) for s in sessions] == [1, 1, 1] and sessions[0].block_size == 512
    assert [(r.input_length, r.output_length) for s in sessions for r in s.requests()] == [
        (10240, 4), (12700, 40), (600, 1)]


def test_prompts_equal_ids_equal_tokens(tmp_path) -> None:
    (parent,) = load_traces([agent_trace(tmp_path)])
    explore, plan = parent.steps[2]
    other = load_traces([write(tmp_path / "other.json", {"id": "other", "requests": [req(0.0, 150, [1, 2])]})])[0]
    b = PromptBuilder(vocab=512)
    p0, p1 = b.prompt(parent, parent.requests()[0]), b.prompt(parent, parent.requests()[1])
    assert len(p0) == 150 and len(p1) == 200 and all(100 <= t < 512 for t in p0 + p1)
    assert p0[:128] == p1[:128]  # blocks 1, 2 shared
    assert p0[128:] != p1[128:150]  # past the full blocks: this request's own tokens
    assert b.prompt(explore, explore.requests()[0])[:128] == p0[:128]  # a sub-agent shares its parent's scope
    assert b.prompt(other, other.requests()[0])[:64] != p0[:64]  # another file, same ids: other tokens
    s1, s2 = b.prompt(explore, explore.requests()[0]), b.prompt(explore, explore.requests()[1])
    assert s1[:192] == s2[:192] and s1[:64] != b.prompt(plan, plan.requests()[0])[:64]
    assert PromptBuilder(vocab=512).prompt(parent, parent.requests()[0]) == p0  # deterministic
    assert PromptBuilder(vocab=512, seed=1).prompt(parent, parent.requests()[0])[:64] != p0[:64]
    # block_tokens scales every length: 8 tokens a 64-token block
    small = PromptBuilder(vocab=512, block_tokens=8)
    q0, q1 = small.prompt(parent, parent.requests()[0]), small.prompt(parent, parent.requests()[1])
    assert (len(q0), len(q1)) == (round(150 / 8), 25) and q0[:16] == q1[:16]
    # Mooncake: ceil(in / 512) ids, the last block trimmed
    moon = load_traces([mooncake_trace(tmp_path)])
    m = [PromptBuilder(vocab=512, block_tokens=16).prompt(s, s.requests()[0]) for s in moon]
    assert [len(x) for x in m] == [320, round(12700 / 32), round(600 / 32)] and m[0] == m[1][:320]
    with pytest.raises(ValueError):
        PromptBuilder(vocab=100)


def test_generator_ranges_and_determinism(tmp_path) -> None:
    params = GenParams()
    sessions = synthesize(6, seed=3)
    assert sessions == synthesize(6, seed=3) and synthesize(2, seed=3) == sessions[:2]
    assert synthesize(1, seed=4) != sessions[:1]
    write_sessions(sessions, tmp_path / "w")
    loaded = load_traces([tmp_path / "w"])
    assert [s.name for s in loaded] == [s["id"] for s in sessions]
    appends = []
    for s in sessions:
        reqs = s["requests"]
        assert s["block_size"] == 64 and s["hash_id_scope"] == "local"
        assert 8 <= len(reqs) <= 12 and 15_000 <= reqs[0]["in"] <= 60_000
        assert reqs[0]["think_time"] == 0 and all(r["think_time"] > 0 for r in reqs[1:])
        assert all(b["t"] > a["t"] for a, b in zip(reqs, reqs[1:]))
        seen: set[int] = set()
        for a, b in zip([None, *reqs], reqs):
            assert len(b["hash_ids"]) == b["in"] // 64
            if a is not None:
                appends.append(b["in"] - a["in"])
                kept = 0
                while kept < len(a["hash_ids"]) and a["hash_ids"][kept] == b["hash_ids"][kept]:
                    kept += 1
                assert not seen & set(b["hash_ids"][kept:])  # past the kept prefix every id is new
            seen |= set(b["hash_ids"])
    assert all(params.append_clip[0] <= x <= params.append_clip[1] for x in appends)
    assert 100 < sorted(appends)[len(appends) // 2] < 3000  # the median of the fit is 699
    d = describe(read_agent_json([tmp_path / "w"]))
    assert d["sessions"] == 6 and d["subagents"] == 0 and d["requests"] == sum(len(s["requests"]) for s in sessions)
    narrow = synthesize(3, seed=1, params=GenParams(turns=(10, 10), context=(15_000, 48_000)))
    assert all(len(s["requests"]) == 10 and 15_000 <= s["requests"][0]["in"] <= 48_000 for s in narrow)
    with pytest.raises(ValueError):
        GenParams(turns=(5, 2))


@pytest.mark.skipif(not SAMPLES.is_dir(), reason="sample traces not present")
def test_generator_parameters_are_the_samples_fit() -> None:
    d = describe(read_agent_json([SAMPLES]))
    p = GenParams()
    assert d["sessions"] == 7 and d["requests"] == 132 and d["subagents"] == 0
    fitted = {"append_mu": d["appended"]["lognormal"]["mu"], "append_sigma": d["appended"]["lognormal"]["sigma"],
              "out_mu": d["output"]["lognormal"]["mu"], "out_sigma": d["output"]["lognormal"]["sigma"],
              "think_mu": d["think_s"]["short"]["mu"], "think_sigma": d["think_s"]["short"]["sigma"],
              "pause_mu": d["think_s"]["pause"]["mu"], "pause_sigma": d["think_s"]["pause"]["sigma"],
              "think_pause_p": d["think_s"]["pause_p"], "tail_rewrite_p": d["tail_rewrites"]["p"],
              "rewrite_p": d["rewrites"]["p"], "api_base_s": d["api_time"]["base_s"],
              "api_tokens_per_s": d["api_time"]["tokens_per_s"]}
    for name, value in fitted.items():
        assert math.isclose(getattr(p, name), value, abs_tol=0.0005 if name != "api_tokens_per_s" else 0.05), name


def small_server(start_server, tmp_path: Path):
    """random:tiny with a GPU pool smaller than two sessions together: pages move down to host."""
    return start_server("--config", str(tiny_config(tmp_path, **{"cache.device.size_tokens": 512})))


def test_agent_cli_against_server(start_server, tmp_path, capsys) -> None:
    server = small_server(start_server, tmp_path)
    work = tmp_path / "work"
    assert main(["bench", "agent-gen", "--sessions", "2", "--turns", "4:4", "--context", "6400:9600", "--seed", "5",
                 "--out", str(work)]) == 0
    sessions = read_agent_json([work])
    out = tmp_path / "agent.json"
    # 2 tokens a 64-token block: prompts of 267-334 tokens (within the tiny model's 2048 positions)
    code = main(["bench", "agent", str(work), "--url", server.url, "--block-tokens", "2", "--vocab", "512",
                 "--max-context", "2048", "--json", str(out)])
    assert code == 0
    table = capsys.readouterr().out
    assert "2 sessions (0 of them sub-agents), 8 requests" in table and "\n all " in table and "turn" in table
    data = json.loads(out.read_text())
    o = data["overall"]
    assert o["requests"] == 8 and o["errors"] == 0 and o["skipped_requests"] == 0 and o["sessions"] == 2
    assert o["completion_tokens"] == sum(min(r["out"], 16) for s in sessions for r in s["requests"])
    assert o["prompt_tokens"] == sum(round(r["in"] / 32) for s in sessions for r in s["requests"])
    rounds = data["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2, 3] and rounds[0]["cached_tokens"] == 0
    for r in rounds[1:]:  # every later turn extends its session's previous prompt: its pages are cached
        assert r["cached_tokens"] > 0 and r["cache_hit_rate"] > 0.3
    tiers = o["cache_hit_rate_per_tier"]
    assert set(tiers) == {"device", "host", "disk", "remote"}
    assert math.isclose(sum(tiers.values()), o["cache_hit_rate"])
    assert sum(o["cached_tokens_per_tier"].values()) == o["cached_tokens"] > 0
    m = data["server_metrics"]
    assert m["hicache_prompt_tokens_total"] == o["prompt_tokens"]
    assert sum(m[f'hicache_cache_hit_tokens_total{{tier="{t}"}}'] for t in tiers) == o["cached_tokens"]
    assert data["settings"]["max_context"] == 2048 and data["settings"]["block_tokens"] == 2


def test_subagents_and_mooncake_against_server(start_server, tmp_path) -> None:
    server = small_server(start_server, tmp_path)
    opts = AgentOptions(url=server.url, traces=(str(agent_trace(tmp_path)),), vocab=512, output_length=4)
    report = asyncio.run(asyncio.wait_for(run_agent(opts), timeout=120))
    assert report.overall["errors"] == 0 and report.overall["requests"] == 6
    assert report.settings["sessions"] == 1 and report.settings["subagent_sessions"] == 2
    assert report.settings["max_context"] == 512  # the server's max_model_len: what its GPU pool holds
    by = {(t.client, t.round): t for t in report.turns}
    parent_2nd, parent_3rd = by[(0, 1)], by[(0, 2)]
    subs = [by[(1, 0)], by[(1, 1)], by[(2, 0)]]
    assert all(t.start >= parent_2nd.end for t in subs)  # started when the parent reached them
    assert parent_3rd.start >= max(t.end for t in subs)  # the parent waited for both
    assert by[(1, 0)].cached_tokens > 0  # the sub-agent resends the parent's first blocks: same scope, same tokens
    assert by[(2, 0)].cached_tokens == 0
    # Mooncake: one-request sessions, open loop; one at a time, in file order, so the second hits the first
    opts = AgentOptions(url=server.url, traces=(str(mooncake_trace(tmp_path)),), vocab=512, block_tokens=16,
                        time_scale=0.0, concurrency=1)
    report = asyncio.run(asyncio.wait_for(run_agent(opts), timeout=120))
    turns = sorted(report.turns, key=lambda t: t.client)
    assert [t.prompt_tokens for t in turns] == [320, 397, 19] and report.overall["errors"] == 0
    assert [t.completion_tokens for t in turns] == [4, 16, 1]  # min(the trace's out, --output-length 16)
    assert turns[1].cached_tokens >= 304 and turns[2].cached_tokens == 0
    # a request over --max-context is skipped and counted
    opts = AgentOptions(url=server.url, traces=(str(mooncake_trace(tmp_path)),), vocab=512, block_tokens=16,
                        time_scale=0.0, max_context=330)
    report = asyncio.run(asyncio.wait_for(run_agent(opts), timeout=120))
    assert report.overall["requests"] == 2 and report.overall["skipped_requests"] == 1
    assert report.overall["skipped"] == [{"session": "mooncake:2", "turn": 0, "tokens": 397}]
