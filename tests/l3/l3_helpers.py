"""Shared helpers for the L3 tests (also imported by the subprocess scripts)."""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import torch

NAMESPACE = hashlib.blake2b(b"test-model/rev/bf16/layout/p16", digest_size=16).digest()
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def key(i: int) -> bytes:
    """The i-th test page key (16 bytes)."""
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def content(k: bytes, page_bytes: int) -> torch.Tensor:
    """Deterministic page bytes derived from a key."""
    rng = np.random.default_rng(int.from_bytes(k[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, page_bytes, dtype=np.uint8))


def empty(page_bytes: int, n: int = 1) -> list[torch.Tensor]:
    return [torch.zeros(page_bytes, dtype=torch.uint8) for _ in range(n)]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    # in front of the caller's path, not instead of it: packages installed with --target live there
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, os.path.dirname(os.path.abspath(__file__)), *inherited])
    return env


PYTHON = sys.executable
