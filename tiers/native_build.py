"""Small C loops compiled on first use with the system's C compiler, for the few places where Python's per-call
cost is the bottleneck (tiers/l3/native.py: a page's I/O and hashing; hicache/replay/reuse.py: the LRU stack-depth
pass). Each source is compiled once into a per-user cache ($HICACHE_NATIVE_CACHE, else $XDG_CACHE_HOME/hicache,
else ~/.cache/hicache), keyed by a hash of the source and the compiler, and loaded with ctypes, which releases the
interpreter lock for each call. The sources need only libc. Where there is no compiler ($CC, else `cc`, else
`gcc`), the build fails, or $HICACHE_NATIVE=0, `build` returns None with one log line and the caller keeps its
Python loop.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where compiled loops are kept (see the module doc)."""
    explicit = os.environ.get("HICACHE_NATIVE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "hicache"


def compiler() -> str | None:
    """The C compiler to use, or None."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def enabled() -> bool:
    return os.environ.get("HICACHE_NATIVE", "1") != "0"


def _compile(cc: str, source: str, target: Path) -> None:
    """Compile `source` into `target` (atomically: another process may be compiling the same file)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        src = Path(tmp) / (target.stem + ".c")
        src.write_text(source)
        out = Path(tmp) / target.name
        done = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                              capture_output=True, text=True, timeout=120)
        if done.returncode:
            raise RuntimeError(f"{cc} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
        os.replace(out, target)


def build(name: str, source: str, what: str) -> ctypes.CDLL | None:
    """The compiled `source` as a ctypes library, or None (logged, naming `what` falls back to Python)."""
    if not enabled():
        logger.info("%s: the Python loop ($HICACHE_NATIVE=0)", what)
        return None
    cc = compiler()
    if cc is None:
        logger.info("%s: the Python loop (no C compiler: set $CC or install cc for the native one)", what)
        return None
    key = hashlib.sha256((source + "\0" + cc).encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    try:
        if not target.exists():
            try:
                _compile(cc, source, target)
            except OSError:  # the cache folder cannot be written (a read-only home): one under the temporary dir
                target = Path(tempfile.gettempdir()) / f"hicache-native-{os.getuid()}" / target.name
                if not target.exists():
                    _compile(cc, source, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        logger.warning("%s: the Python loop (the native one did not build or load: %s)", what, e)
        return None
    logger.info("%s: the native loop (%s)", what, target)
    return lib
