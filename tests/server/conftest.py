"""Fixtures: `hicache serve` subprocesses on free loopback ports, always killed at teardown."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import ServerProcess, tiny_config


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator:
    """A factory: start_server(*args, env=...) -> a ready ServerProcess; all are killed at teardown."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, ready: bool = True) -> ServerProcess:
        server = ServerProcess(list(args), tmp_path / f"server-{len(started)}.log", env)
        started.append(server)
        return server.wait_ready() if ready else server

    yield start
    for server in started:
        server.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One shared server (random:tiny, all three tiers) for the API tests."""
    directory = tmp_path_factory.mktemp("server")
    proc = ServerProcess(["--config", str(tiny_config(directory))], directory / "server.log")
    try:
        yield proc.wait_ready()
    finally:
        proc.kill()
