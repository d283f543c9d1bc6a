"""`hicache generate`: run one prompt through the engine (and its cache tiers) and print the completion."""

from __future__ import annotations

import argparse
import sys
import time

from hicache.config import load_config, override
from hicache.engine.params import SamplingParams

_DEFAULTS = SamplingParams()


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=None, help="default: scheduler.default_max_tokens")
    p.add_argument("--temperature", type=float, default=_DEFAULTS.temperature,
                   help="sampling temperature (default %(default)s: it samples, so runs differ unless --seed is "
                        "given; 0 = greedy, the same tokens every run)")
    p.add_argument("--top-p", type=float, default=_DEFAULTS.top_p, help="nucleus sampling (default %(default)s: off)")
    p.add_argument("--top-k", type=int, default=_DEFAULTS.top_k, help="sample from the k likeliest tokens "
                   "(default %(default)s: off)")
    p.add_argument("--seed", type=int, default=_DEFAULTS.seed, help="seed of the sampler: the same seed, the same "
                   "tokens (default: none)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("--model", default=None, help="model name or directory (overrides model.name)")
    p.add_argument("--device", default=None, help="auto, cpu, cuda, cuda:N (overrides model.device)")
    p.add_argument("--l3-path", default=None, help="NVMe store directory (overrides cache.l3.path)")
    p.add_argument("--stats", action="store_true", help="print cache and timing stats to stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config)
    dotted = {"model.name": args.model, "model.device": args.device, "cache.l3.path": args.l3_path}
    cfg = override(cfg, {k: v for k, v in dotted.items() if v is not None})
    try:
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
            max_tokens=args.max_tokens, stop=tuple(args.stop),
        )
    except ValueError as e:
        print(f"hicache generate: {e}", file=sys.stderr)
        return 2
    from hicache.engine.llm import LLM  # loads torch and the model: only when the command runs

    with LLM(cfg) as llm:
        prompt = args.prompt
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
                {"role": "user", "content": prompt}
            ]
            prompt = llm.tokenizer.encode_chat(messages, add_generation_prompt=True)
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0]
        elapsed = time.perf_counter() - start
        if out.error is not None:
            print(f"hicache generate: {out.error}", file=sys.stderr)
            return 1
        print(out.text)
        if args.stats:
            print(f"# {out.prompt_tokens} prompt tokens (cached {out.cached_tokens}), {len(out.token_ids)} "
                  f"generated, finish {out.finish_reason}, ttft {out.ttft:.3f}s, total {elapsed:.3f}s",
                  file=sys.stderr)
    return 0
