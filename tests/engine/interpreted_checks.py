"""Every Triton interpreter check in one process: started by conftest.py in the background with TRITON_INTERPRET=1
(Triton's CPU interpreter must be chosen before Triton is imported, hence a subprocess), so torch and Triton are
imported once, not once per kernel, while the other tests run.

Usage: python interpreted_checks.py OUT_DIR SECTION...   (sections: see SECTIONS)

Each section's results go to OUT_DIR/SECTION.pt as soon as it is done; a section that raises writes its traceback
to OUT_DIR/SECTION.error and the next one still runs (the mixed step needs the decode kernel under the interpreter,
which Triton 3.6's cannot run: the prefix kernel's checks must not fail with it; so those two go last).
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"

import torch  # noqa: E402


def fused() -> dict:
    import fused_ops_check

    return fused_ops_check.cases()


def prefill() -> dict:
    import prefill_kernel_check

    return {"kernel": prefill_kernel_check.kernel_cases(), "model": prefill_kernel_check.model_cases()}


def decode() -> dict:
    import decode_kernel_check

    return {"kernel": decode_kernel_check.kernel_cases(), "model": decode_kernel_check.model_cases()}


def mixed() -> dict:
    import prefill_kernel_check

    return prefill_kernel_check.mixed_cases()


SECTIONS = {"fused": fused, "prefill": prefill, "decode": decode, "mixed": mixed}  # the order they run in


def main(out_dir: Path, wanted: list[str]) -> None:
    for name, run in SECTIONS.items():
        if name not in wanted:
            continue
        try:
            results = run()
        except Exception:
            (out_dir / f"{name}.error").write_text(traceback.format_exc())
            continue
        tmp = out_dir / f"{name}.pt.tmp"
        torch.save(results, tmp)
        os.replace(tmp, out_dir / f"{name}.pt")


if __name__ == "__main__":
    unknown = set(sys.argv[2:]) - set(SECTIONS)
    assert not unknown, f"unknown sections {unknown}"
    main(Path(sys.argv[1]), sys.argv[2:])
