"""Fixtures for scheduler/engine tests: random:tiny loaded once per session (SmolLM2: tests/conftest.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache.engine.weights import load_model


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, Any]:
    return load_model("random:tiny", torch.float32, torch.device("cpu"))

