"""Helpers for server tests: a real `hicache serve` subprocess on a free loopback port, configs, /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

STARTUP_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_config(directory: Path, **overrides: object) -> Path:
    """A YAML config: random:tiny on CPU, small tiers, write-through down to an L3 store in `directory`."""
    cfg = {
        "model": {"name": "random:tiny", "device": "cpu", "dtype": "float32"},
        "cache": {
            "page_size": 16,
            "device": {"size_tokens": 4096},
            "host": {"size_tokens": 8192},
            "l3": {"path": str(directory / "l3"), "size_gib": None, "size_tokens": 32768, "io_backend": "buffered",
                   "io_threads": 2},
            "write_policy": {"device_to_host": "write_through", "host_to_disk": "write_through"},
            "load_policy": {"mode": "always"},  # no prefill calibration at startup; every hit is used
        },
        "scheduler": {"max_running_requests": 64, "chunk_tokens": 512, "default_max_tokens": 16},
    }
    for key, value in overrides.items():
        node = cfg
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class ServerProcess:
    """`hicache serve` as a subprocess; `stop()` sends SIGTERM and waits, `kill()` makes sure it is gone."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "ab")
        cmd = [sys.executable, "-m", "hicache.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait for the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log.close()


def metrics(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed with prometheus_client: (sample name, sorted labels) -> value."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(values: dict, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.1) -> bool:
    """Poll predicate() until it is true or timeout (bounded loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
