"""The Triton interpreter checks (interpreted_checks.py) run in one background subprocess per session.

It starts once collection knows which of its sections the selected tests need, and the tests that read its
results run last (in the order it produces them), so the interpreter works while the other tests run.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path

import pytest
from engine_helpers import InterpretedRun

# fixture -> section of interpreted_checks.py, in the order it runs them
SECTION_FIXTURES = {"interpreted_fused": "fused", "interpreted_prefill": "prefill", "interpreted_decode": "decode",
                    "interpreted_mixed": "mixed"}
ORDER = list(SECTION_FIXTURES.values())
RUN = pytest.StashKey[InterpretedRun]()


def sections_of(item: pytest.Item) -> list[str]:
    names = getattr(item, "fixturenames", ())
    return [section for fixture, section in SECTION_FIXTURES.items() if fixture in names]


@pytest.hookimpl(trylast=True)  # after -k and -m deselected what they deselect
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    wanted = {section for item in items for section in sections_of(item)}
    if not wanted or config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    items.sort(key=lambda item: min((ORDER.index(s) for s in sections_of(item)), default=-1))  # stable
    out_dir = Path(tempfile.mkdtemp(prefix="hicache-interpreted-"))
    config.stash[RUN] = InterpretedRun(out_dir, [s for s in ORDER if s in wanted])


def pytest_unconfigure(config: pytest.Config) -> None:
    run = config.stash.get(RUN, None)
    if run is not None:
        run.kill()
        shutil.rmtree(run.out_dir, ignore_errors=True)


def interpreted(request: pytest.FixtureRequest, section: str) -> dict:
    pytest.importorskip("triton", reason="the kernels are written in Triton")
    run = request.config.stash.get(RUN, None)
    if run is None or section not in run.sections:  # not foreseen at collection: a run of its own
        run = InterpretedRun(request.getfixturevalue("tmp_path_factory").mktemp(section), [section])
        request.addfinalizer(run.kill)
    return run.results(section)


@pytest.fixture(scope="session")
def interpreted_fused(request: pytest.FixtureRequest) -> dict:
    return interpreted(request, "fused")


@pytest.fixture(scope="session")
def interpreted_prefill(request: pytest.FixtureRequest) -> dict:
    return interpreted(request, "prefill")


@pytest.fixture(scope="session")
def interpreted_decode(request: pytest.FixtureRequest) -> dict:
    return interpreted(request, "decode")


@pytest.fixture(scope="session")
def interpreted_mixed(request: pytest.FixtureRequest) -> dict:
    """The mixed step needs the decode kernel under the interpreter too, which Triton 3.6's interpreter cannot run
    (the H200 machine's; CI's 3.9 can): its own section, run last, so the prefix kernel's checks need not fail with
    it."""
    return interpreted(request, "mixed")
