"""The C loops built when the package is installed (setup.py), loaded with ctypes.

Two places are bound by Python's per-call cost: the L3's page I/O and hashing (tiers/l3/native_io.c) and the
replay's LRU stack-depth pass (hicache/replay/reuse_stack.c). Each is a plain shared library, built by
`pip install` next to the module that loads it; ctypes releases the interpreter lock for each call. They use no
Python API, so one build serves any interpreter on the machine.

`HICACHE_NATIVE=0` makes `load` return None, and the callers run their Python loops (to compare the two, or to
test the Python loops). A library that is missing (a source tree used without installing it) is logged once as
a WARNING that says how to build it, and the Python loop runs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sysconfig
from pathlib import Path

logger = logging.getLogger(__name__)

BUILD_HINT = "build it with `pip install -e .` (or `python setup.py build_ext --inplace`), which needs a C compiler"


def enabled() -> bool:
    """Whether the native loops may be used ($HICACHE_NATIVE=0 turns them off)."""
    return os.environ.get("HICACHE_NATIVE", "1") != "0"


def library_path(directory: Path, name: str) -> Path | None:
    """The built library `name` in `directory`: this interpreter's build first, else any other's (the libraries
    use no Python API); None if there is none."""
    own = directory / f"{name}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"
    if own.exists():
        return own
    others = sorted(directory.glob(f"{name}.*.so")) + sorted(directory.glob(f"{name}.so"))
    return others[0] if others else None


def load(directory: Path, name: str, what: str) -> ctypes.CDLL | None:
    """The native library `name` built in `directory`, or None (logged, naming `what`) where it is turned off or
    missing."""
    if not enabled():
        logger.info("%s: the Python loop ($HICACHE_NATIVE=0)", what)
        return None
    path = library_path(directory, name)
    if path is None:
        logger.warning("%s: the Python loop, slower: the native library %s is not built in %s; %s", what, name,
                       directory, BUILD_HINT)
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        logger.warning("%s: the Python loop, slower: %s did not load (%s); %s", what, path, e, BUILD_HINT)
        return None
