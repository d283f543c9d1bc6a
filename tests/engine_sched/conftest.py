"""Fixtures for scheduler/engine tests: models loaded once per session."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hicache.engine.weights import load_model


@pytest.fixture(scope="session")
def tiny() -> tuple[Any, Any]:
    return load_model("random:tiny", torch.float32, torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm() -> tuple[Any, Any]:
    return load_model("smollm2-135m-instruct", torch.float32, torch.device("cpu"))

