"""`hicache serve`: the OpenAI-compatible server (FastAPI on uvicorn). Flags override the YAML config."""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from hicache.config import Config, ConfigError, ServerConfig, load_config, override, parse_settings, set_tier_tokens
from radix import DEVICE, TIERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "HICACHE_API_KEY"
_SERVER = ServerConfig()


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    p = sub.add_parser("serve", help="serve the OpenAI API (chat, completions, models, health, metrics)",
                       description="Serve a model through the three-tier KV cache. Flags override --config.")
    p.add_argument("--config", help="YAML config file (default: built-in defaults)")
    p.add_argument("--model", help="model name, random:<preset> or Hugging Face directory (model.name)")
    p.add_argument("--served-model-name", help="model id reported by /v1/models and expected in requests")
    p.add_argument("--device", help="auto, cpu, cuda, cuda:N (model.device)")
    p.add_argument("--tp", type=int, metavar="N",
                   help="tensor parallelism: split the model over N processes, one a GPU (model.tp_size)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), help="model.dtype")
    p.add_argument("--host", help=f"address to bind (default {_SERVER.host}; server.host)")
    p.add_argument("--port", type=int, help=f"port (default {_SERVER.port}; server.port)")
    p.add_argument("--l3-path", help="NVMe store directory (cache.l3.path); the disk tier is on when set")
    p.add_argument("--no-l3", action="store_true", help="disable the disk tier")
    p.add_argument("--remote-url", metavar="URL",
                   help="remote tier on a Valkey/Redis server: redis://[[USER]:PASSWORD@]HOST[:PORT][/DB] "
                        "(cache.remote.url; password also from $HICACHE_REMOTE_PASSWORD), or on a Mooncake Store: "
                        "mooncake://MASTER:PORT?metadata=URL (the mooncake extra; docs/remote-tier.md)")
    for tier in TIERS:
        note = "at least one page" if tier == DEVICE else "0 disables it"
        p.add_argument(f"--{tier}-tokens", type=int, metavar="N", help=f"{tier} tier capacity in tokens ({note})")
    p.add_argument("--page-size", type=int, help="tokens per KV page (cache.page_size)")
    p.add_argument("--load-mode", choices=("auto", "always", "never"), help="cache.load_policy.mode")
    p.add_argument("--load-overlap", action=argparse.BooleanOptionalAction,
                   help="compute a prefix's first pages while its last pages load (cache.load_policy.overlap)")
    p.add_argument("--max-running-requests", type=int, help="scheduler.max_running_requests")
    p.add_argument("--chunk-tokens", type=int, help="prefill tokens per step (scheduler.chunk_tokens)")
    p.add_argument("--max-context-tokens", type=int, help="context limit (scheduler.max_context_tokens)")
    p.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' on /v1 (or set ${API_KEY_ENV})")
    p.add_argument("--metrics-key", help="with API keys, the bearer key a /metrics scrape needs to see the per-tenant "
                   "series (server.metrics_key)")
    p.add_argument("--tenants", metavar="FILE", help="a YAML file of tenants: each one's API keys and share of the "
                   "cache; a tenant's requests match only its own cached prefixes (server.tenants_file; "
                   "docs/server.md, 'Tenants')")
    p.add_argument("--max-body-bytes", type=int, help=f"request body limit (default {_SERVER.max_body_bytes})")
    p.add_argument("--trace-log", metavar="FILE", help="append one JSON line per finished request (replayable)")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds SIGTERM waits for in-flight requests before cancelling them (default 60)")
    p.add_argument("--cuda-graph-max-batch", type=int,
                   help="capture decode CUDA graphs up to this batch, 0 = off (model.cuda_graph_max_batch)")
    p.add_argument("--no-decode-kernel", dest="decode_kernel", action="store_false", default=None,
                   help="decode through the PyTorch reference instead of the Triton kernel (model.decode_kernel)")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--profile-engine", metavar="FILE",
                   help="profile the engine thread (cProfile) and write its stats to FILE on shutdown")
    p.add_argument("--trace-gpu", metavar="FILE",
                   help="record engine steps with torch's profiler: a Chrome trace at FILE, a kernel table at FILE.txt")
    p.add_argument("--trace-steps", metavar="FIRST:COUNT", default="100:20",
                   help="the steps --trace-gpu records: COUNT steps from step FIRST (default 100:20)")
    p.add_argument("--step-log", metavar="FILE",
                   help="append one JSON line per engine step: timings, tokens, queues (docs/server.md)")
    p.add_argument("--set", dest="settings", action="append", default=[], metavar="KEY=VALUE",
                   help="set any config key, applied last; VALUE is YAML (e.g. --set "
                        "cache.write_policy.defer_above_free=1.0); repeatable")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace) -> Config:
    """The config file with the command line's overrides applied (ConfigError on bad values)."""
    cfg = load_config(args.config)
    dotted: dict[str, Any] = {
        "model.name": args.model, "model.device": args.device, "model.dtype": args.dtype, "model.tp_size": args.tp,
        "model.cuda_graph_max_batch": args.cuda_graph_max_batch, "model.decode_kernel": args.decode_kernel,
        "server.host": args.host, "server.port": args.port, "server.served_model_name": args.served_model_name,
        "server.max_body_bytes": args.max_body_bytes, "server.trace_log": args.trace_log,
        "server.tenants_file": args.tenants, "server.metrics_key": args.metrics_key,
        "cache.page_size": args.page_size, "cache.load_policy.mode": args.load_mode,
        "cache.load_policy.overlap": args.load_overlap,
        "scheduler.max_running_requests": args.max_running_requests, "scheduler.chunk_tokens": args.chunk_tokens,
        "scheduler.max_context_tokens": args.max_context_tokens,
        "cache.l3.path": args.l3_path,
        "cache.remote.url": args.remote_url,
    }
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if api_key is not None:
        if not api_key.strip():  # an empty key would read as "no key": the server would serve everyone
            source = "--api-key" if args.api_key is not None else f"${API_KEY_ENV}"
            raise ConfigError(f"{source}: the API key is empty (leave it unset for a server without auth)")
        dotted["server.api_key"] = api_key
    cfg = override(cfg, {k: v for k, v in dotted.items() if v is not None})
    if args.no_l3:
        cfg = override(cfg, {"cache.l3.path": None})
    for tier in TIERS:
        tokens = getattr(args, f"{tier}_tokens")
        if tokens is not None:
            cfg = set_tier_tokens(cfg, tier, tokens)
    return override(cfg, parse_settings(getattr(args, "settings", [])), "--set")


def _trace_window(text: str) -> tuple[int, int]:
    """--trace-steps FIRST:COUNT as (first, count); ConfigError names the flag if it is malformed."""
    first, sep, count = text.partition(":")
    try:
        window = int(first), int(count)
    except ValueError:
        window = (-1, 0)
    if not sep or window[0] < 0 or window[1] < 1:
        raise ConfigError(f"--trace-steps {text!r}: expected FIRST:COUNT with FIRST >= 0 and COUNT >= 1, e.g. 100:20")
    return window


def run(args: argparse.Namespace) -> int:
    """Build the engine, then serve until SIGINT/SIGTERM (which drain requests and close the L3 store)."""
    cfg = build_config(args)
    import uvicorn  # the server stack and torch load only when the command runs

    class _Server(uvicorn.Server):
        """uvicorn's server, but a drained SIGTERM/SIGINT ends with exit code 0 (uvicorn re-raises the signal)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    from hicache import gc_stats
    from hicache.engine.builder import build_engine
    from hicache.engine.runner import AsyncEngine
    from hicache.server.app import create_app
    from hicache.server.http import protocol_options
    from hicache.server.tenants import Tenants

    trace = _trace_window(args.trace_steps) if args.trace_gpu else None
    tenants = Tenants.build(cfg.server.api_key, cfg.server.tenants_file)  # a bad file fails before anything else
    sock = preflight(cfg)  # a busy port or a bad L3 path fails now, not after the model has loaded
    from hicache.engine.engine import EngineHalted

    try:
        built = build_engine(cfg)
    except EngineHalted as e:  # a tensor-parallel rank that failed to start (its own log says why)
        sock.close()
        print(f"hicache serve: the tensor-parallel group did not start: {e}", file=sys.stderr)
        exit_without_teardown(1, always=True)
        return 1
    built.cache.controller.set_shares(tenants.shares())
    if trace is not None:
        built.trace_gpu(args.trace_gpu, *trace)
    if args.step_log:
        built.open_step_log(args.step_log)
    engine = AsyncEngine(built, profile_path=args.profile_engine)
    # `kill -USR1 PID` writes every thread's stack to stderr (the server log): where a stuck engine thread waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        s = cfg.server
        app = create_app(engine, cfg, s.served_model_name or cfg.model.name, tenants, s.trace_log)
        gc_stats.freeze_startup()  # the model, the cache stack and the app live as long as the process
        gc_stats.process_timer()  # /metrics reports the collections from here on (serving, not startup)
        config = uvicorn.Config(app, host=s.host, port=s.port, log_config=None, access_log=args.access_log,
                                timeout_graceful_shutdown=args.drain_timeout, lifespan="on",
                                timeout_keep_alive=s.keep_alive_s,
                                **protocol_options(s.header_timeout_s, s.body_timeout_s))
        logger.info("serving %s on http://%s:%d (auth %s, tenants: %s)", cfg.model.name, s.host, s.port,
                    "on" if tenants.auth_required else "off", ", ".join(tenants.names))
        server = _Server(config)
        if cfg.model.tp_size > 1:  # a lost rank ends the engine thread: the server goes with it
            threading.Thread(target=_stop_with_engine, args=(engine.runner, server), name="hicache-engine-watch",
                             daemon=True).start()
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown()  # already done by the app's shutdown unless startup failed
    if engine.runner.error is not None and cfg.model.tp_size > 1:
        print(f"hicache serve: the tensor-parallel engine stopped: {engine.runner.error}", file=sys.stderr)
        exit_without_teardown(1, always=True)  # a broken process group can abort the interpreter's teardown
    exit_without_teardown(0)
    return 0


def _stop_with_engine(runner: Any, server: Any) -> None:
    """Once the engine thread has ended with an error (a tensor-parallel rank lost), stop serving: its requests
    have been failed, and no other can be served."""
    runner.join()
    if runner.error is not None:
        logger.error("the engine stopped (%s): shutting the server down", runner.error)
        server.should_exit = True


def exit_without_teardown(code: int, always: bool = False) -> None:
    """End the process once serving is over and everything is closed (engine, L3 store, sockets), skipping the
    interpreter's teardown: there Triton's nanobind bindings print some 30 lines of "nanobind: leaked ..." (its
    own objects, not ours), which read as a crash at every clean shutdown. Only where Triton is loaded, unless
    `always`."""
    if "triton" not in sys.modules and not always:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def preflight(cfg: Any) -> socket.socket:
    """What can fail in seconds is checked before the model loads (which can take minutes): the listening socket
    (bound here and handed to uvicorn, so nobody takes the port meanwhile) and the L3 store's directory (exists or
    can be created, writable, no other writer) and the trace log. ConfigError / L3Error name what is wrong."""
    s = cfg.server
    family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((s.host, s.port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"server: cannot listen on {s.host}:{s.port}: {e.strerror or e} (--host / --port)") from None
    sock.set_inheritable(True)
    if s.trace_log:  # the trace log opens for appending at startup: a path it cannot use fails now
        try:
            with open(s.trace_log, "a"):
                pass
        except OSError as e:
            sock.close()
            raise ConfigError(f"server.trace_log (--trace-log): cannot append to {s.trace_log!r}: "
                              f"{e.strerror or e}") from None
    path = cfg.cache.l3.path
    if path:
        from hicache.cache import l3_directory
        from tiers.l3.lockfile import WriterLock, prepare_directory

        try:
            prepare_directory(os.path.abspath(path), read_only=False)
            for rank in range(cfg.model.tp_size):  # tensor parallelism: a store a rank, in directories of path
                directory = os.path.abspath(l3_directory(cfg, rank))
                prepare_directory(directory, read_only=False)
                WriterLock(directory).release()  # only a probe: the store takes the lock itself
        except OSError:
            sock.close()
            raise
    return sock
