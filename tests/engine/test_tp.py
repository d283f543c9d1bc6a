"""Tensor parallelism on the CPU (gloo): a model split over 2 and 4 ranks (4 > its 2 KV heads: replicated) gives
the logits and greedy tokens of one rank; shapes that cannot be split are refused by name; a rank that dies
ends the others with an error, not a hang (hicache/engine/tp/shard.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hicache.engine.tp.shard import check_divisible, kv_heads_of
from hicache.modelinfo import RANDOM_PRESETS
from hicache.valkey_local import free_port

RANK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tp_rank.py")


def _run(model: str, size: int, out: str, *extra: str, timeout: float = 120) -> list[subprocess.CompletedProcess]:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, RANK, model, str(r), str(size), str(port), out, *extra],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for r in range(size)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tp") / "tp1.pt")
    (r,) = _run("random:tiny", 1, out)
    assert r.returncode == 0, r.stderr[-2000:]
    return torch.load(out)


@pytest.mark.parametrize("size, load", [(2, "cut"), (4, "cut"), (2, "whole-then-cut")])
def test_split_ranks_give_one_ranks_logits_and_tokens(reference, tmp_path, size, load):
    out = str(tmp_path / f"tp{size}.pt")
    results = _run("random:tiny", size, out, *(["--whole-then-cut"] if load == "whole-then-cut" else []))
    assert all(r.returncode == 0 for r in results), [r.stderr[-1500:] for r in results]
    got = torch.load(out)
    assert got["ids"] == reference["ids"]
    assert torch.allclose(got["logits"], reference["logits"], atol=1e-4, rtol=1e-4)
    assert got["kv_heads"] == max(1, 2 // size)  # tiny has 2 KV heads: 1 a rank at TP 2, and at TP 4 (replicated)


def test_a_rank_that_dies_ends_the_others_with_an_error(tmp_path):
    """The survivor's collective fails: gloo either raises (a named error) or aborts the process (SIGABRT, seen
    on a loaded machine); both end it, neither hangs (a hang fails `_run`'s timeout)."""
    results = _run("random:tiny", 2, str(tmp_path / "x.pt"), "--die-after-steps", "2", "--timeout-s", "10",
                   timeout=90)
    assert results[1].returncode == 3  # the one that died
    survivor = results[0]
    assert (survivor.returncode == 4 and "rank 0:" in survivor.stderr) or survivor.returncode == -6, (
        survivor.returncode, survivor.stderr[-1500:])


def test_shapes_that_cannot_be_split_are_refused_by_name():
    tiny = RANDOM_PRESETS["tiny"]
    with pytest.raises(ValueError, match="3 ranks: 4 attention heads, 2 KV heads"):
        check_divisible(tiny, 3)
    check_divisible(tiny, 4)
    assert [kv_heads_of(tiny, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_heads_of(tiny, r, 2) for r in range(2)] == [(0, 1), (1, 2)]


def test_a_rank_reads_only_its_part_of_each_tensor_from_a_checkpoint(tmp_path, monkeypatch):
    from engine_helpers import hf_and_ours

    from hicache.engine import weights
    from hicache.engine.tp.shard import TPShard, cut_tensor, parameter_cut
    from hicache.engine.weights import load_model

    _, whole = hf_and_ours(tmp_path, "llama")  # 4 heads, 2 KV heads, MLP 96, vocabulary 256
    full = {name: p.detach().clone() for name, p in whole.named_parameters()}
    whole_reads, slice_reads = [], []
    real_open = weights.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.handle = real_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self.handle.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_tensor(self, key):
            whole_reads.append(key)
            return self.f.get_tensor(key)

        def get_slice(self, key):
            slice_reads.append(key)
            return self.f.get_slice(key)

    monkeypatch.setattr(weights, "safe_open", Recording)
    monkeypatch.setattr(weights, "load_file", lambda *a, **k: pytest.fail("a rank read a whole checkpoint file"))
    for rank in (0, 1):
        whole_reads.clear()
        slice_reads.clear()
        config = whole.config
        ours, _ = load_model(str(tmp_path / "llama"), torch.float32, torch.device("cpu"), shard=TPShard(rank, 2))
        assert ours.config.num_heads == 2 and ours.config.num_kv_heads == 1 and ours.config.intermediate_size == 48
        read_cut = {k.removeprefix("model.") for k in slice_reads}
        assert read_cut and not read_cut & {k.removeprefix("model.") for k in whole_reads}
        assert {n.split(".")[-2] for n in read_cut} == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                        "up_proj", "down_proj", "lm_head"}
        head = cut_tensor(full["lm_head.weight"], parameter_cut(config, "lm_head.weight", rank, 2))
        assert torch.equal(ours.head_shard, head)  # the rank's vocabulary rows, read as a slice


def test_the_cache_namespace_carries_the_tensor_parallel_size_only_above_one():
    from hicache.cache import namespace_fields
    from radix import namespace_fingerprint
    from tiers import KVLayout

    layout = KVLayout(2, 1, 16, 4, 4)
    one = namespace_fields("m", "r", "float32", layout, 0)
    assert "tp_size" not in one  # stores written without tensor parallelism keep their namespace
    assert namespace_fields("m", "r", "float32", layout, 0, 1) == one
    two = namespace_fields("m", "r", "float32", layout, 0, 2)
    assert two["tp_size"] == 2 and two["tp_rank"] == 0
    assert namespace_fingerprint(two) != namespace_fingerprint(one)  # a TP=2 rank 0 never reads a TP=1 store
    assert namespace_fingerprint(namespace_fields("m", "r", "float32", layout, 1, 2)) != namespace_fingerprint(two)
