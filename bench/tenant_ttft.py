"""Tenant isolation, timed: is another tenant's copy of a prompt as slow as a miss?

Isolation must close the timing side channel as well as `cached_tokens`: a tenant that sends another tenant's
prompt must wait as long as for any prompt nobody sent. Each trial, on one engine (one request at a time):
  1. alice sends a prompt nobody sent (a miss);
  2. bob sends alice's prompt (another tenant's copy), right after;
  3. alice sends it again (her own hit).
TTFT is the engine's own (request arrival to first token, `StepOutput.ttft`).

The check (exit 1 if it fails): bob's median is within `--tolerance` of the miss median, and alice's hit is
faster than both (so the measurement could have told them apart).

Usage: .venv/bin/python bench/tenant_ttft.py [--model smollm2-135m-instruct] [--prompt-tokens 512] [--trials 12]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.config import Config, override  # noqa: E402
from hicache.engine.builder import build_engine  # noqa: E402
from hicache.engine.params import SamplingParams  # noqa: E402
from hicache.server.tenants import Tenants  # noqa: E402

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def ttft(engine, request_id: str, prompt: list[int], namespace) -> tuple[float, int]:
    """(seconds to the first token, cached prompt tokens) of one request run alone."""
    engine.add_request(request_id, prompt, ONE_TOKEN, namespace)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.ttft is not None and first is None:
                first = out.ttft
            if out.finished:
                cached = out.usage.total_cached_tokens
    return first, cached


def summary(values: list[float]) -> str:
    q = statistics.quantiles(values, n=4)
    return f"median {statistics.median(values) * 1000:7.1f} ms  (IQR {q[0] * 1000:.1f}-{q[2] * 1000:.1f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--tolerance", type=float, default=0.10, help="bob's median vs the miss median (fraction)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tenants.yaml"
        path.write_text("tenants:\n  alice: {keys: [ka]}\n  bob: {keys: [kb]}\n")
        tenants = Tenants.build(None, str(path))
        alice, bob = (tenants.namespace(t, None) for t in tenants.tenants)
        cfg = override(Config(), {"model.name": args.model, "model.device": args.device, "model.dtype": "float32",
                                  "cache.l3.path": None, "cache.load_policy.mode": "always"})
        engine = build_engine(cfg, calibrate=False)
        engine.cache.controller.set_shares(tenants.shares())
        vocab = engine.model.config.vocab_size
        rng = random.Random(7)
        ttft(engine, "warm", [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)], alice)
        miss, other, hit = [], [], []
        for trial in range(args.trials):
            prompt = [rng.randrange(1, vocab) for _ in range(args.prompt_tokens)]
            for kind, namespace, out in (("miss", alice, miss), ("other", bob, other), ("hit", alice, hit)):
                seconds, cached = ttft(engine, f"{kind}-{trial}", prompt, namespace)
                if (cached > 0) != (kind == "hit"):
                    print(f"the {kind} request of trial {trial} found {cached} cached tokens", file=sys.stderr)
                    return 1
                out.append(seconds)
        engine.close()

    print(f"{args.model} on {args.device}, {args.prompt_tokens}-token prompts, {args.trials} trials")
    print(f"  miss (a prompt nobody sent)       {summary(miss)}")
    print(f"  another tenant's copy of a prompt  {summary(other)}")
    print(f"  the tenant's own hit               {summary(hit)}")
    ratio = statistics.median(other) / statistics.median(miss)
    print(f"  another tenant's / miss: {ratio:.3f}")
    ok = abs(ratio - 1.0) <= args.tolerance and statistics.median(hit) < min(statistics.median(miss),
                                                                             statistics.median(other))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
