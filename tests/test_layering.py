"""The packages depend one way: radix <- controller <- hicache, tiers <- controller. Read from the source, so an
import hidden in a function body counts too."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROJECT = ("radix", "tiers", "controller", "hicache")

# package -> the project packages (and heavy libraries) it must never import
FORBIDDEN = {
    "radix": {"tiers", "controller", "hicache", "torch", "numpy"},
    "tiers": {"radix", "controller", "hicache"},
    "controller": {"hicache"},
}


def imports_of(path: Path) -> set[str]:
    """Top-level names of every module `path` imports (absolute imports; the project uses no relative ones)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import of {node.module!r}")
            names.add(node.module.split(".")[0])
    return names


def test_imports_of_reads_nested_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("import os.path\nfrom radix import tree\ndef f():\n    import torch\n")
    assert imports_of(src) == {"os", "radix", "torch"}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_downwards(package):
    bad = []
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    for path in files:
        for name in sorted(imports_of(path) & FORBIDDEN[package]):
            bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_modelinfo_does_not_import_the_engine():
    """Sizing tiers from a model's shape must not need the engine (and its kernels) loaded."""
    path = ROOT / "hicache" / "modelinfo.py"
    tree = ast.parse(path.read_text())
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not {m for m in modules if m and m.startswith("hicache.engine")}


def test_radix_imports_without_torch():
    code = "import sys, radix; radix.RadixTree(4); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_command_line_and_the_replay_path_import_no_torch():
    """`hicache --help`, input errors and `hicache replay` need no torch: it takes seconds to import."""
    code = ("import sys; from hicache.cli import build_parser; build_parser(); import hicache.replay.core, "
            "hicache.replay.cli, hicache.replay.simulate; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_replay_run_with_the_default_config_imports_no_torch(tmp_path):
    """Sizing the tiers (model.dtype auto, model.device auto) must not import torch to ask whether CUDA is there."""
    trace = tmp_path / "t.jsonl"
    records = [{"timestamp": i, "input_length": 1024, "output_length": 8, "hash_ids": [1, i + 2]} for i in range(20)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in records))
    code = ("import sys; from hicache.cli import main; rc = main(['replay', sys.argv[1], '--no-progress']); "
            "print(rc, 'torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code, str(trace)], cwd=ROOT, capture_output=True, text=True)
    assert out.stderr.strip().splitlines()[-1] == "0 False", out.stderr[-2000:]


def module_imports(path: Path) -> set[str]:
    """Full names of the project modules `path` imports (absolute `import` and `from` statements)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {n for n in names if n.split(".")[0] in PROJECT}


# a room -> the rooms it must never import (modules below it, or siblings it must not know)
ROOMS = {
    "radix/node.py": ("radix.tree", "radix.order", "radix.namespace", "radix.integrity"),
    "radix/order.py": ("radix.tree", "radix.node"),
    "radix/integrity.py": ("radix.tree",),
    # the disk store knows nothing of the remote tier (its runtime, worker.py and process*.py, serves both)
    "tiers/l3/store*.py": ("tiers.remote", "tiers.persistent", "tiers.l3.worker", "tiers.l3.process"),
    "tiers/remote": ("tiers.l3.store", "tiers.l3.worker", "tiers.l3.process", "tiers.persistent"),
    "hicache/engine/kernels": ("hicache.engine.tp", "hicache.engine.engine", "hicache.engine.scheduler",
                               "hicache.engine.builder", "hicache.cache", "hicache.server"),
    "hicache/engine/tp": ("hicache.engine.builder", "hicache.server"),
    "hicache/engine/assembly.py": ("hicache.engine.builder", "hicache.engine.tp"),
    "hicache/replay": ("hicache.bench_client", "hicache.engine", "hicache.server"),
}
# imports a room may make below a forbidden name: the replay's time model runs the server's own scheduler, whose
# modules import no torch (test_the_command_line_and_the_replay_path_import_no_torch runs them)
EXCEPT = {
    "hicache/replay": ("hicache.engine.scheduler", "hicache.engine.waiting", "hicache.engine.request",
                       "hicache.engine.params"),
}


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_rooms_import_only_what_they_may(room):
    target = ROOT / room
    files = sorted(ROOT.glob(room)) if "*" in room else sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert files, f"nothing at {room}"
    bad = []
    for path in files:
        for name in sorted(module_imports(path)):
            if any(name == e or name.startswith(e + ".") for e in EXCEPT.get(room, ())):
                continue
            if any(name == f or name.startswith(f + ".") for f in ROOMS[room]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


ENGINES = {"vllm", "sglang"}


def test_only_the_integrations_import_the_engines():
    """vLLM and SGLang are optional extras: nothing outside hicache/integrations/ may need either to import."""
    bad = []
    for package in PROJECT:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.is_relative_to(ROOT / "hicache" / "integrations"):
                continue
            bad += [f"{path.relative_to(ROOT)} imports {name}" for name in sorted(imports_of(path) & ENGINES)]
    assert not bad, "\n".join(bad)
    assert imports_of(ROOT / "hicache" / "integrations" / "vllm.py") & ENGINES == {"vllm"}
