"""SIGKILL a writer mid-run: everything it reported as committed survives, nothing served is garbage."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import torch
from l3_helpers import NAMESPACE, PYTHON, content, empty, subprocess_env

from tiers.l3 import L3Store
from tiers.l3.inspect import inspect_store

PAGE = 8192
CAPACITY = 4096  # pages; more than the writer reaches before the kill, so nothing committed is evicted


def test_sigkill_loses_nothing_committed(tmp_path):
    script = os.path.join(os.path.dirname(__file__), "l3_crash_writer.py")
    writer = subprocess.Popen([PYTHON, script, str(tmp_path / "s"), str(PAGE), str(CAPACITY)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env(), text=True)
    committed: list[bytes] = []
    deadline = time.monotonic() + 45
    while len(committed) < 400 and time.monotonic() < deadline:
        line = writer.stdout.readline()
        if not line:
            break
        committed.append(bytes.fromhex(line.strip()))
    writer.send_signal(signal.SIGKILL)
    rest, err = writer.communicate(timeout=30)  # lines flushed before the kill are committed too
    committed += [bytes.fromhex(line) for line in rest.split("\n") if len(line) == 32]
    assert writer.returncode == -signal.SIGKILL
    assert len(committed) >= 400, err

    report = inspect_store(tmp_path / "s", verify=True)
    assert report["verify"]["bad"] == 0  # every page the store would serve verifies
    assert report["pages"] >= len(committed)
    with L3Store(tmp_path / "s", CAPACITY * PAGE, PAGE, NAMESPACE) as store:  # the lock died with the writer
        out = empty(PAGE, len(committed))
        assert store.read_pages(committed, out) == [True] * len(committed)
        for k, page in zip(committed, out):
            assert torch.equal(page, content(k, PAGE))
        everything = store.keys()
        out = empty(PAGE, len(everything))
        assert store.read_pages(everything, out) == [True] * len(everything)
        assert all(torch.equal(page, content(k, PAGE)) for k, page in zip(everything, out))
        assert store.stats()["checksum_failures"] == 0
        store.check_integrity()
