"""The `hicache` command: one subcommand per module, each registering its own parser.

Exit codes: 0 success, 1 a failed check (e.g. `l3 inspect --verify` found bad pages),
2 bad input (config error, bad flag, unreadable file).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from hicache.config import ConfigError

# Modules that add subcommands: each has `register(subparsers)` setting `func` on its parser.
SUBCOMMAND_MODULES = (
    "hicache.commands.config_cmd",
    "hicache.commands.l3_cmd",
    "hicache.engine.cli",
    "hicache.server.cli",
    "hicache.replay.cli",
    "hicache.bench_client.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description="Three-tier KV cache for LLM serving")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):
                continue  # that part of the application is not installed in this tree
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        code = int(args.func(args) or 0)
    except ConfigError as e:
        print(f"hicache: config error: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:  # a host tier larger than the memory available (tiers.host_pool.HostMemoryError)
        if e.__class__.__module__.startswith("tiers"):
            print(f"hicache: host memory error: {e}", file=sys.stderr)
            return 2
        raise
    except OSError as e:  # e.g. the L3 store path: missing parent, not a directory, not writable, in use
        if e.__class__.__module__.startswith("tiers.l3"):
            print(f"hicache: L3 store error: {e.strerror or e}", file=sys.stderr)
            return 2
        raise
    # not under a profiler or tracer (cProfile, coverage): they write their results at exit
    if argv is None and getattr(args, "exit_without_teardown", False) and sys.getprofile() is None \
            and sys.gettrace() is None:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """End the process without freeing what it built: for a command run from the command line (argv from sys.argv)
    whose objects number in the millions, whose files are closed and which has no other thread. Logging and the
    standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
