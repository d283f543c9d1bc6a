"""Tensor-parallel serving on the CPU (gloo): the engine at TP=2 and TP=4 (random:tiny: 4 heads, 2 KV heads, so
one KV head a rank at 2, and each kept by 2 ranks at 4) against TP=1 through the same scenario
(tests/engine/tp_lockstep_rank.py): greedy outputs token for token, prefix hits from host memory and from L3, a
read that fails on one rank only, the early exits (a full batch, an idle engine), and the collectives of every
rank; then `hicache serve --tp 2`, answering and losing a rank."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from hicache.config import ConfigError, from_dict

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "server"))  # server_helpers: tiny_config, free_port
RANK = HERE / "tp_lockstep_rank.py"
ROOT = HERE.parents[1]
RUN_TIMEOUT_S = 180
SIZES = (1, 2, 4)  # at 4 ranks each of the 2 KV heads is kept by 2 ranks
SPLIT = pytest.mark.parametrize("tp", [2, 4])


def scenario_config(directory: Path, tp: int) -> dict:
    """Small tiers (12 GPU pages, 24 host pages of 4 tokens), write-through to L3, every hit loaded."""
    return {
        "model": {"name": "random:tiny", "device": "cpu", "dtype": "float32", "tp_size": tp, "tp_timeout_s": 30.0},
        "cache": {
            "page_size": 4,
            "device": {"size_tokens": 48},
            "host": {"size_tokens": 96},
            "l3": {"path": str(directory / "l3"), "size_tokens": 4096, "io_backend": "buffered", "io_threads": 1},
            # queued writes may pin the whole (24-page) host pool: its default share would be 3 pages
            "write_policy": {"device_to_host": "write_through", "host_to_disk": "write_through",
                             "defer_above_free": 1.0, "l3_host_share": 1.0},
            "load_policy": {"mode": "always"},
        },
        "scheduler": {"max_running_requests": 2, "chunk_tokens": 32},
    }


def _env() -> dict[str, str]:
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), *inherited])}


def run_scenarios(configs: dict[int, tuple[Path, dict]], scenario: str = "full") -> dict[int, dict]:
    """The scenario with each config (by TP size), run side by side; each run's results, and the followers'
    collective logs."""
    procs = {}
    for tp, (directory, cfg) in configs.items():
        config = directory / "config.json"
        config.write_text(json.dumps(cfg))
        log = open(directory / "run.log", "wb")
        procs[tp] = (directory, log, subprocess.Popen([sys.executable, str(RANK), "leader", str(config),
                                                       str(directory / "out.json"), scenario],
                                                      stdout=log, stderr=subprocess.STDOUT, env=_env()))
    results = {}
    for tp, (directory, log, proc) in procs.items():
        try:
            code = proc.wait(RUN_TIMEOUT_S)
        finally:
            if proc.poll() is None:
                proc.kill()
            log.close()
        assert code == 0, (directory / "run.log").read_text()[-4000:]
        result = json.loads((directory / "out.json").read_text())
        result["dir"] = directory
        result["follower_logs"] = {int(p.stem.split("-")[1]): json.loads(p.read_text())
                                   for p in directory.glob("rank-*.json")}
        results[tp] = result
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    """The full scenario at TP=1, 2 and 4."""
    configs = {}
    for tp in SIZES:
        directory = tmp_path_factory.mktemp(f"tp{tp}")
        configs[tp] = (directory, scenario_config(directory, tp))
    return run_scenarios(configs)


def test_smollm2_over_three_ranks_gives_one_ranks_greedy_tokens(tmp_path):
    """The real model (9 heads, 3 KV heads: one a rank), its checkpoint read shard by shard, no host or L3."""
    configs = {}
    for tp in (1, 3):
        directory = tmp_path / f"tp{tp}"
        directory.mkdir()
        cfg = scenario_config(directory, tp)
        cfg["model"]["name"] = "smollm2-135m-instruct"
        cfg["cache"] = {"page_size": 16, "device": {"size_tokens": 512}, "host": {"size_tokens": 0},
                        "load_policy": {"mode": "always"}}
        configs[tp] = (directory, cfg)
    results = run_scenarios(configs, "greedy")
    one, three = results[1], results[3]
    assert [o["tokens"] for o in three["batch"]] == [o["tokens"] for o in one["batch"]]
    assert len(three["batch"]) == 2 and all(len(o["tokens"]) == 4 for o in three["batch"])
    assert three["miss"]["tokens"] == one["miss"]["tokens"] and len(one["miss"]["tokens"]) == 8
    for rank in (1, 2):
        assert three["follower_logs"][rank] == three["collectives"]


@SPLIT
def test_greedy_outputs_equal_one_ranks_token_for_token(runs, tp):
    one, two = runs[1], runs[tp]
    assert [o["tokens"] for o in two["batch"]] == [o["tokens"] for o in one["batch"]]
    assert all(len(o["tokens"]) == 6 and o["error"] is None for o in two["batch"])
    assert two["miss"]["tokens"] == one["miss"]["tokens"]
    assert sum(two["miss"]["cached"].values()) == 0


@SPLIT
def test_prefix_hits_from_host_and_from_l3_give_the_outputs_of_a_miss(runs, tp):
    one, two = runs[1], runs[tp]
    assert two["host"]["cached"] == one["host"]["cached"] == {"device": 0, "host": 36, "disk": 0, "remote": 0}
    # the host pool may keep the first pages, as long as the fillers' L3 writes pin theirs: at most 2 of the 9
    assert sum(two["disk"]["cached"].values()) == 36 and two["disk"]["cached"]["disk"] >= 28
    for phase in ("host", "disk"):
        assert two[phase]["tokens"] == two["miss"]["tokens"] == one[phase]["tokens"]


@SPLIT
def test_a_prefix_read_into_host_memory_while_its_request_waits_gives_the_outputs_of_a_miss(runs, tp):
    one, two = runs[1], runs[tp]
    # how much of the prefix was still in host memory, and how much of the prefetched part the request used at
    # admission, depends on when the fillers' L3 writes and the reads landed (at TP=1 too): not compared
    assert two["prefetched_pages"] > 0 and one["prefetched_pages"] > 0
    assert sum(two["prefetched"]["cached"].values()) > 0
    assert two["prefetched"]["tokens"] == two["miss"]["tokens"] == one["prefetched"]["tokens"]
    assert all(f["error"] is None for f in two["fillers"]) and len(two["fillers"]) == 7


@SPLIT
def test_a_read_that_fails_on_one_rank_is_recomputed_on_every_rank(runs, tp):
    """Rank 1's slab was overwritten: its reads fail their checksums while rank 0's succeed. The controller sees
    the reads fail (no L3 hit is counted) and recomputes; the outputs, which the all-reduces make from every
    rank's KV, are a miss's."""
    one, two = runs[1], runs[tp]
    assert two["corrupted_bytes"] > 0
    assert one["load_failures"] == 0 and one["failed_read"]["cached"]["disk"] >= 28  # TP=1: a plain L3 hit
    assert two["load_failures"] >= 1
    assert two["failed_read"]["cached"]["disk"] == 0
    assert two["failed_read"]["error"] is None
    assert two["failed_read"]["tokens"] == one["failed_read"]["tokens"] == two["miss"]["tokens"]


@SPLIT
def test_every_rank_made_the_same_collectives(runs, tp):
    """Through the full batch, the idle engine and the failed read: the same collectives in the same order, with
    the same shapes, on every rank; one plan broadcast and one report gather per exchange."""
    two = runs[tp]
    leader = two["collectives"]
    assert len(leader) > 100
    assert sorted(two["follower_logs"]) == list(range(1, tp))
    for rank, follower in two["follower_logs"].items():
        assert follower == leader, f"rank {rank}"
    plans = [c for c in leader if c in ("broadcast_object_list", "all_gather_object")]
    exchanges = (len(plans) - 1) // 2
    # per exchange a plan and a gather of reports, then the stop plan
    assert plans == ["broadcast_object_list", "all_gather_object"] * exchanges + ["broadcast_object_list"]
    assert any(c.startswith("all_reduce") for c in leader) and any(c.startswith("all_gather[") for c in leader)
    assert two["idle_exchanges"] >= 2  # heartbeats while nothing ran (one a second)


def test_each_rank_keeps_its_own_store_under_its_own_namespace(runs):
    from tiers.l3.slab import read_header, slab_path

    one = read_header(slab_path(str(runs[1]["dir"] / "l3"))).namespace
    ranks = [read_header(slab_path(str(runs[tp]["dir"] / "l3" / f"tp{tp}-rank{r}"))).namespace
             for tp in (2, 4) for r in range(tp)]
    assert len({one, *ranks}) == 7  # a TP=2 store is never opened (nor its pages served) at TP=1, nor by another rank


def test_sizes_and_options_that_cannot_split_are_refused_by_name(tmp_path):
    base = scenario_config(tmp_path, 1)
    with pytest.raises(ConfigError, match="model.tp_size: must be > 0"):
        from_dict({**base, "model": {**base["model"], "tp_size": 0}})
    with pytest.raises(ConfigError, match="model.tp_rank: must be 0 with model.tp_size 2"):
        from_dict({**base, "model": {**base["model"], "tp_size": 2, "tp_rank": 1}})
    with pytest.raises(ConfigError, match="model.device: 'cuda:1' names one GPU"):
        from_dict({**base, "model": {**base["model"], "tp_size": 2, "device": "cuda:1"}})
    with pytest.raises(ConfigError, match="model.tp_timeout_s: must be > 0"):
        from_dict({**base, "model": {**base["model"], "tp_timeout_s": 0.0}})
    from hicache.engine.builder import build_engine

    cfg = from_dict({**base, "model": {**base["model"], "tp_size": 3}})
    with pytest.raises(ConfigError, match="cannot be split over 3 ranks: 4 attention heads"):
        build_engine(cfg)  # refused before any rank starts


def test_a_rank_that_fails_to_start_is_named_at_once(tmp_path):
    import torch

    from hicache.engine.tp.engine import build_tp_engine
    from hicache.engine.tp.lockstep import RankLost

    threads = torch.get_num_threads()  # building a leader shares the CPU's threads among the ranks
    config = scenario_config(tmp_path, 2)
    config["model"]["tp_start_timeout_s"] = 3600.0  # noticed as it exits: a wait for the timeout would hang here
    try:
        with pytest.raises(RankLost, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code 3"):
            build_tp_engine(from_dict(config), calibrate=False,
                            follower_command=[sys.executable, "-c", "raise SystemExit(3)"])
    finally:
        torch.set_num_threads(threads)


def test_the_server_flag_sets_the_size(tmp_path):
    from hicache.cli import build_parser
    from hicache.server.cli import build_config

    config = tmp_path / "c.json"
    config.write_text(json.dumps(scenario_config(tmp_path, 1)))
    args = build_parser().parse_args(["serve", "--config", str(config), "--tp", "2"])
    assert build_config(args).model.tp_size == 2


# ---------------------------------------------------------------------- the server


def _serve(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, Path]:
    from server_helpers import free_port, tiny_config

    port = free_port()
    log_path = tmp_path / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", "--config", str(tiny_config(tmp_path)),
                             "--host", "127.0.0.1", "--port", str(port), "--tp", "2", *extra],
                            stdout=log, stderr=subprocess.STDOUT, env=_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return proc, url, log_path
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"server not ready:\n{log_path.read_text()[-4000:]}")


def _running(pid: int) -> bool:
    """Whether process pid still runs (an exited one waiting for its parent to reap it, a zombie, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while _running(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _follower_pid(log_path: Path) -> int:
    match = re.search(r"started ranks 1\.\.1 \(pids (\d+)\)", log_path.read_text())
    assert match, log_path.read_text()[-2000:]
    return int(match.group(1))


@pytest.fixture
def reference_completion(tmp_path):
    """What one rank answers: the same prompt through an engine at TP=1 with the server's config."""
    from server_helpers import tiny_config

    from hicache.config import load_config
    from hicache.engine.llm import LLM

    directory = tmp_path / "reference"
    directory.mkdir()
    with LLM(load_config(tiny_config(directory)), calibrate=False) as llm:
        return llm.generate("a prompt for two ranks", temperature=0, max_tokens=8, ignore_eos=True)[0]


def test_serve_tp2_answers_a_completion_as_one_rank_does(tmp_path, reference_completion):
    proc, url, log_path = _serve(tmp_path)
    try:
        r = httpx.post(f"{url}/v1/completions", json={"model": "random:tiny", "prompt": "a prompt for two ranks",
                                                      "max_tokens": 8, "temperature": 0, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["text"] == reference_completion.text
        from server_helpers import metric, metrics, wait_for

        assert metric(metrics(url), "hicache_tp_plans_total") >= 8  # a plan for each forward at least (8 tokens)
        # the prompt's page backed up to host once the engine idles (write-through deferred while the GPU has room)
        assert wait_for(lambda: metric(metrics(url), "hicache_tp_ops_total") > 0)
        proc.terminate()
        assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        assert "tensor parallel: 2 ranks" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_prefix_computed_by_one_tp2_server_is_a_shared_tier_hit_on_another(tmp_path, valkey, reference_completion):
    """Two servers at TP=2 share one Valkey: each rank writes its own shard under its rank's namespace, and the
    second server's ranks read theirs back (greedy output as TP=1's)."""
    from server_helpers import metric, metrics, wait_for

    body = {"model": "random:tiny", "prompt": "a prompt for two ranks", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    shared = ("--no-l3", "--remote-url", valkey.url, "--set", "cache.remote.key_prefix=tp-shared-test")
    answers = []
    for name in ("a", "b"):
        directory = tmp_path / name
        directory.mkdir()
        proc, url, log_path = _serve(directory, *shared)
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json())
            if name == "a":  # sent again, the prefix is reused, so rank 0's pages reach the remote tier
                r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # (write_policy.l3_admit: reuse)
                assert r.status_code == 200, r.text
                assert wait_for(lambda u=url: metric(metrics(u), "hicache_remote_operations_total", op="writes") > 0)
            # a clean exit waits for every rank, and a rank finishes its queued writes as it closes its tiers
            proc.terminate()
            assert proc.wait(60) == 0, log_path.read_text()[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
    first, second = answers
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == reference_completion.text
    assert first["usage"]["prompt_tokens_details"]["cached_tokens_per_tier"]["remote"] == 0
    assert second["usage"]["prompt_tokens_details"]["cached_tokens_per_tier"]["remote"] > 0


def test_a_rank_killed_mid_request_ends_the_server_with_a_named_error(tmp_path):
    proc, url, log_path = _serve(tmp_path)
    pid = _follower_pid(log_path)
    try:
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"model": "random:tiny", "prompt": "a long answer", "max_tokens": 1500,
                                "temperature": 0, "ignore_eos": True, "stream": True}) as stream:
            assert stream.status_code == 200, stream.read()
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 3:
                        os.kill(pid, 9)  # a follower dies while the request decodes
        code = proc.wait(60)  # a hang fails here
        log = log_path.read_text()
        assert code == 1, log[-3000:]
        assert f"tensor-parallel rank 1 (pid {pid}) exited with code -9" in log
        assert "hicache serve: the tensor-parallel engine stopped" in log
        error = json.loads(lines[-2].removeprefix("data: "))["error"]  # the request's error, then [DONE]
        assert lines[-1] == "data: [DONE]"
        assert "RankLost" in error["message"] and f"tensor-parallel rank 1 (pid {pid})" in error["message"]
    finally:
        if proc.poll() is None:
            proc.kill()



def test_a_rank_that_stops_answering_ends_the_server_within_the_collective_timeout(tmp_path):
    """A follower frozen (SIGSTOP) while the server idles: the next heartbeat's gather waits model.tp_timeout_s,
    then the server ends with an error; nothing hangs."""
    proc, url, log_path = _serve(tmp_path, "--set", "model.tp_timeout_s=2")
    pid = _follower_pid(log_path)
    os.kill(pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        code = proc.wait(60)  # a hang fails here
        waited = time.monotonic() - stopped
        log = log_path.read_text()
        assert code == 1, log[-3000:]
        assert "a tensor-parallel rank did not answer within 2 s (model.tp_timeout_s)" in log, log[-3000:]
        assert waited >= 2  # not before the timeout; the message above says it was the timeout that ended it
        assert _wait_gone(pid, 10)  # the server took the frozen rank with it
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_killed_server_takes_its_ranks_with_it(tmp_path):
    """The leader killed outright (no shutdown of its own): the follower's next collective fails and it exits."""
    proc, url, log_path = _serve(tmp_path)
    pid = _follower_pid(log_path)
    proc.kill()
    proc.wait(10)
    try:
        # its next collective fails as the leader's sockets close; the timeout (60 s) would bound it otherwise
        assert _wait_gone(pid, 30), f"rank 1 (pid {pid}) still runs 30 s after its leader was killed"
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
