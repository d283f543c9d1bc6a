"""A local Mooncake master for the Mooncake remote tier's opt-in test and benchmark (tiers/remote/mooncake.py).

`find_master()` is the `mooncake_master` of the `mooncake-transfer-engine-non-cuda` wheel (the `mooncake` extra),
found without importing the package. `LocalMaster` runs it on loopback with its built-in HTTP metadata service,
waits until it accepts connections, and stops it; `url()` is the `cache.remote.url` that reaches it.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import time

from hicache.valkey_local import free_port


def find_master() -> str | None:
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, "mooncake_master")
        if os.path.isfile(path):
            return path
    return None


class LocalMaster:
    """mooncake_master on 127.0.0.1 (RPC and HTTP metadata on free ports); `start()` returns once it listens."""

    def __init__(self, log_path: str | None = None) -> None:
        binary = find_master()
        if binary is None:
            raise RuntimeError("no mooncake_master found: pip install 'hicache[mooncake]'")
        if not os.access(binary, os.X_OK):
            os.chmod(binary, 0o755)  # a wheel unpacked without its modes
        self.binary, self.log_path = binary, log_path
        self.rpc_port, self.http_port = free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, **params: int | str) -> str:
        """The remote tier's URL for this master, with extra client parameters (segment_mib=..., ...)."""
        extra = "".join(f"&{k}={v}" for k, v in params.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}/metadata{extra}"

    def start(self, timeout_s: float = 10.0) -> LocalMaster:
        args = [self.binary, "--rpc_port", str(self.rpc_port), "--rpc_address", "127.0.0.1",
                "--enable_http_metadata_server=true", "--http_metadata_server_host", "127.0.0.1",
                "--http_metadata_server_port", str(self.http_port)]
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with status {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"mooncake_master did not listen on port {self.rpc_port} within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
