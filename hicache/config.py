"""Typed configuration: frozen nested dataclasses loaded from YAML (safe_load) and validated.

Every key is checked against the dataclass fields: an unknown key, a wrong type or an impossible
value raises ConfigError naming the dotted key and the file. hicache/sizes.py turns the tier sizes
(GiB or tokens) into pages once the model's KV bytes per token is known.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from controller.policy import WritePolicy

DEFAULT_L3_GIB = 1.0  # an L3 with a path and no size (hicache/sizes.py)
DEFAULT_REMOTE_GIB = 4.0  # a remote tier with a URL and no size


class ConfigError(ValueError):
    """A bad configuration value; the message names the key and the file."""


@dataclass(frozen=True)
class ModelConfig:
    name: str = "smollm2-135m-instruct"  # built-in name, random:<preset>, or a Hugging Face directory
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    revision: str = ""  # recorded in the cache namespace; empty = derived from the weights file
    tp_rank: int = 0  # the rank whose shard this process serves alone (tp_size 1); `hicache serve --tp` sets ranks
    # tensor parallelism: the model split over this many processes, one rank per GPU (hicache.engine.tp.engine);
    # rank 0 runs the scheduler, the radix tree and the controller, and every rank follows its plan each step
    tp_size: int = 1
    # every collective between the ranks ends with an error after this long (a rank lost, not a hang)
    tp_timeout_s: float = 60.0
    # how long the ranks may take to start: load their shards and build their tiers
    tp_start_timeout_s: float = 600.0
    # decode tokens attend through the paged Triton kernel where it runs (CUDA with Triton); false: the
    # PyTorch reference (gather + SDPA)
    decode_kernel: bool = True
    # on CUDA, silu(gate) * up and the rotary embedding as one Triton kernel each (hicache.engine.kernels.fused)
    # instead of PyTorch's two and three; false: PyTorch's ops
    fused_elementwise: bool = True
    # prefill chunks over a cached prefix: "triton" reads the context in place through the page table
    # (hicache.engine.kernels.prefill; CUDA with Triton, else sdpa), faster than sdpa at long context
    # (bench/RESULTS.md, 'Prefix attention kernel'); "sdpa" gathers the context and runs PyTorch's flash attention
    prefill_attention: Literal["sdpa", "triton"] = "triton"
    # decode steps of up to this many sequences replay a CUDA graph captured at startup (CUDA, decode
    # kernel on); 0 disables. Capped at scheduler.max_running_requests
    cuda_graph_max_batch: int = 64


@dataclass(frozen=True)
class TierSize:
    """A tier's size: exactly one of size_gib / size_tokens (0 disables host and disk tiers)."""

    size_gib: float | None = None
    size_tokens: int | None = None


@dataclass(frozen=True)
class L3Config:
    path: str | None = None  # directory of the NVMe store; None disables the disk tier
    size_gib: float | None = None  # give one of size_gib / size_tokens; neither: DEFAULT_L3_GIB
    size_tokens: int | None = None
    io_backend: Literal["auto", "kvikio", "posix", "buffered"] = "auto"
    io_threads: int = 4
    queue_pages: int = 4096  # bounded queue of pending L3 writes; beyond it they wait in the controller, unpinned
    sync_batch_pages: int | None = None  # pages per fdatasync + index commit; None: max(32, 64 MiB of pages)
    admission_hits: int = 0  # write a page to L3 only after it was hit this many times (0 = always)
    # bandwidth caps of the store in GB/s (0: none), token buckets in the store: emulate an NVMe of a given speed on
    # tmpfs, or keep this server to its share of a disk that several use (tiers/l3/ratelimit.py)
    read_limit_gbps: float = 0.0
    write_limit_gbps: float = 0.0
    # where the store's I/O, checksums and index commits run: "process" (a process of its own, reading and writing
    # the host pool through shared memory: no interpreter lock shared with the engine thread), "thread" (threads
    # of the server's process), or "auto": process with a CUDA model unless GPUDirect Storage is active
    worker: Literal["auto", "process", "thread"] = "auto"


@dataclass(frozen=True)
class RemoteConfig:
    """The remote tier: pages in a Valkey/Redis server that several hicache servers use (tiers/remote/valkey.py)."""

    url: str | None = None  # redis://[[USER]:PASSWORD@]HOST[:PORT][/DB]; None disables the remote tier
    username: str | None = None
    password: str | None = None  # also $HICACHE_REMOTE_PASSWORD; wins over the URL's
    key_prefix: str = "hicache"
    # pages of the remote tier this server's tree keeps track of (the server evicts on its own: keep it near the
    # server's maxmemory); give one of size_gib / size_tokens; neither: DEFAULT_REMOTE_GIB
    size_gib: float | None = None
    size_tokens: int | None = None
    timeout_s: float = 2.0  # every call: connect, probe, read, write
    admission_hits: int = 0  # write a page to the remote tier only after it was offered this many times


@dataclass(frozen=True)
class LoadPolicyConfig:
    """Whether to load cached pages or recompute them, from costs measured at startup or given here."""

    mode: Literal["auto", "always", "never"] = "auto"
    prefill_tokens_per_s: float | None = None  # None: calibrate at startup
    # prefill nanoseconds per (token, earlier token) pair: a token deep in a prompt costs more to recompute, as it
    # attends to every token before it (CostModel). None: calibrated with the prefill speed (0 if that is set here)
    attention_ns_per_pair: float | None = None
    host_to_device_gbps: float | None = None
    disk_to_device_gbps: float | None = None
    # mode auto: compute the first pages of a prefix while its last pages load, when that finishes sooner than
    # loading or computing it all (a disk slower than prefill: deep pages load, cheap first pages are computed; and
    # prefetch reads a queued request's deepest pages first). false: one cut, load a prefix and compute the rest.
    # Other modes ignore it
    overlap: bool = True
    # CUDA: host -> GPU loads go layer by layer under the forward that reads them (tiers/layered_copy.py)
    layered: bool = True
    # read a queued request's disk-only prefix pages into host memory while it waits (L3 on)
    prefetch: bool = True
    # copy a queued request's host-resident prefix onto the GPU pages the admitted requests do not need, so that
    # at admission it is there (controller/staging.py)
    stage: bool = True
    # disk reads in flight and prefetched pages held take at most this share of the host pool
    prefetch_host_share: float = 0.5
    # prefetch keeps at most this many seconds of reads queued on the disk (by its measured bandwidth), adding more
    # as they land; 0: no bound. Reads still queued when their request is admitted are mostly computed instead
    # (the GPU gets there first), so a deep queue spends the disk on pages nobody loads (docs/architecture.md)
    prefetch_queue_s: float = 0.25


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    # lru / lfu: all tiers; lrfu: GPU and host rank pages by decayed frequency, the disk by recency (radix.policy).
    # lru stays the default: on the H200 multi-turn server benchmark lrfu served more hits but a slower median TTFT
    eviction_policy: Literal["lrfu", "lru", "lfu"] = "lru"
    device: TierSize = field(default_factory=lambda: TierSize(size_tokens=4096))
    host: TierSize = field(default_factory=lambda: TierSize(size_gib=1.0))
    l3: L3Config = field(default_factory=L3Config)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    write_policy: WritePolicy = field(default_factory=WritePolicy)  # controller.policy: one class, one set of defaults
    load_policy: LoadPolicyConfig = field(default_factory=LoadPolicyConfig)


@dataclass(frozen=True)
class SchedulerConfig:
    max_running_requests: int = 64
    chunk_tokens: int = 2048  # prefill token budget per step (chunked prefill)
    # a step takes another request's prefill only while it holds fewer prefill tokens than this (0: up to
    # chunk_tokens). Short prompts then finish a few at a time, not all at the end of one big step, which trades
    # some throughput for their time to first token
    prefill_batch_tokens: int = 0
    max_context_tokens: int | None = None  # None: the model's maximum
    default_max_tokens: int = 256
    # start the host -> GPU page loads asked for while scheduling a step only once the step's forward is queued,
    # so the engine thread's time starting them (most of its scheduling time with a host tier) overlaps the GPU's
    # work instead of delaying it (tiers.copy.LaunchLater; bench/RESULTS.md, 'Multi-turn TTFT, host tier vs GPU
    # only')
    launch_loads_after_forward: bool = True
    # admit and prefetch for the next step while this step's forward runs on the GPU, rather than between steps
    # while the GPU waits (Scheduler.admit_ahead). Implies launch_loads_after_forward: the loads it asks for are
    # held and started behind that forward, waiting only for the compute queued before it. A request admitted then
    # starts its reads a forward earlier: with an L3 on a disk the engine's idle time waiting for reads halved
    # (bench/RESULTS.md, 'The disk adds its bandwidth')
    admit_during_forward: bool = True


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # a YAML file of tenants, their API keys and their shares of the cache (hicache/server/tenants.py)
    tenants_file: str | None = None
    # with API keys, /metrics shows the per-tenant series (what each tenant sent and hit) only to a scrape bearing
    # this key: to anyone else they would tell one tenant what another's requests were
    metrics_key: str | None = None
    max_body_bytes: int = 4 << 20
    # a request's headers must arrive within header_timeout_s, its body within body_timeout_s of them
    # (hicache/server/http.py); an idle keep-alive connection closes after keep_alive_s
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    trace_log: str | None = None
    served_model_name: str | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


# ---------------------------------------------------------------------- loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against annotation `tp` and convert; raises ConfigError naming key and source."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{source}: {key}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, key, source)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{source}: {key}: {value!r} is not one of {list(choices)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{source}: {key}: must not be null")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, source)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{source}: {key}: {value!r} has the wrong type")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {key}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{source}: {key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str) and _EXPONENT_NUMBER.fullmatch(value):
            return float(value)  # YAML 1.1 reads 1e12 (no dot) as a string: it is the number its writer meant
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{source}: {key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{source}: {key}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{source}: {key}: unsupported type {_type_name(tp)}")


_EXPONENT_NUMBER = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")


def _build(cls: type, data: dict[str, Any], prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in names:
            raise ConfigError(f"{source}: unknown key {key!r} (allowed: {', '.join(sorted(names))})")
        kwargs[k] = _convert(v, hints[k], key, source)
    return _construct(cls, kwargs, prefix, source)


def _construct(cls: type, kwargs: dict[str, Any], prefix: str, source: str, base: Any = None) -> Any:
    """cls(**kwargs) (or `base` with kwargs replaced): a ValueError of the class's own checks (e.g. WritePolicy's,
    "defer_above_free: must be ...") becomes a ConfigError naming the key's path and the source."""
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{source}: {prefix + '.' if prefix else ''}{e}") from None


def _positive(value: float | int | None, key: str, source: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{source}: {key}: must be finite, got {value}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{source}: {key}: must be {'>= 0' if allow_zero else '> 0'}, got {value}")


# the config's own checks, for other typed options (an engine's tier options, hicache/integrations/options.py):
# build_section(cls, data, prefix, source) and check_positive(value, key, source, allow_zero)
build_section = _build
check_positive = _positive


def _check_size(size: Any, key: str, source: str, allow_zero: bool, optional: bool = False) -> None:
    given = [name for name in ("size_gib", "size_tokens") if getattr(size, name) is not None]
    if optional and not given:
        return
    if len(given) != 1:
        raise ConfigError(f"{source}: {key}: give exactly one of size_gib, size_tokens (got {given or 'none'})")
    _positive(getattr(size, given[0]), f"{key}.{given[0]}", source, allow_zero)


def validate(cfg: Config, source: str = "<config>") -> Config:
    """Check values no type can express; returns cfg unchanged or raises ConfigError."""
    c = cfg.cache
    if c.page_size <= 0 or c.page_size & (c.page_size - 1):
        raise ConfigError(f"{source}: cache.page_size: must be a positive power of two, got {c.page_size}")
    _check_size(c.device, "cache.device", source, allow_zero=False)
    _check_size(c.host, "cache.host", source, allow_zero=True)
    if c.l3.path is not None:
        if not c.l3.path.strip():
            raise ConfigError(f"{source}: cache.l3.path: must not be empty (use null to disable the disk tier)")
        _check_size(c.l3, "cache.l3", source, allow_zero=True, optional=True)
    _positive(c.l3.io_threads, "cache.l3.io_threads", source)
    _positive(c.l3.queue_pages, "cache.l3.queue_pages", source)
    _positive(c.l3.sync_batch_pages, "cache.l3.sync_batch_pages", source)
    _positive(c.l3.admission_hits, "cache.l3.admission_hits", source, allow_zero=True)
    _positive(c.l3.read_limit_gbps, "cache.l3.read_limit_gbps", source, allow_zero=True)
    _positive(c.l3.write_limit_gbps, "cache.l3.write_limit_gbps", source, allow_zero=True)
    if c.remote.url is not None:
        from tiers.persistent import remote_name
        from tiers.remote import RemoteError

        try:
            remote_name(c.remote.url)
        except RemoteError as e:
            raise ConfigError(f"{source}: {e.strerror or e}") from None
        _check_size(c.remote, "cache.remote", source, allow_zero=False, optional=True)
        if not c.remote.timeout_s > 0:
            raise ConfigError(f"{source}: cache.remote.timeout_s: must be > 0, got {c.remote.timeout_s}")
        _positive(c.remote.admission_hits, "cache.remote.admission_hits", source, allow_zero=True)
    for name in ("prefill_tokens_per_s", "host_to_device_gbps", "disk_to_device_gbps"):
        _positive(getattr(c.load_policy, name), f"cache.load_policy.{name}", source)
    _positive(c.load_policy.attention_ns_per_pair, "cache.load_policy.attention_ns_per_pair", source, allow_zero=True)
    _positive(c.load_policy.prefetch_queue_s, "cache.load_policy.prefetch_queue_s", source, allow_zero=True)
    for key, share in (("write_policy.l3_host_share", c.write_policy.l3_host_share),
                       ("load_policy.prefetch_host_share", c.load_policy.prefetch_host_share)):
        if not 0.0 < share <= 1.0:
            raise ConfigError(f"{source}: cache.{key}: must be in (0, 1], got {share}")
    s = cfg.scheduler
    _positive(s.max_running_requests, "scheduler.max_running_requests", source)
    _positive(s.chunk_tokens, "scheduler.chunk_tokens", source)
    _positive(s.prefill_batch_tokens, "scheduler.prefill_batch_tokens", source, allow_zero=True)
    _positive(s.max_context_tokens, "scheduler.max_context_tokens", source)
    _positive(s.default_max_tokens, "scheduler.default_max_tokens", source)
    if not 0 < cfg.server.port < 65536:
        raise ConfigError(f"{source}: server.port: must be in 1..65535, got {cfg.server.port}")
    tenants_file = cfg.server.tenants_file
    if tenants_file is not None and not Path(tenants_file).is_file():
        raise ConfigError(f"{source}: server.tenants_file: {tenants_file!r} is not a file")
    for name in ("api_key", "metrics_key"):
        key = getattr(cfg.server, name)
        if key is not None and not key.strip():
            raise ConfigError(f"{source}: server.{name}: is empty (omit it, or null, to set none)")
    _positive(cfg.server.max_body_bytes, "server.max_body_bytes", source)
    for name in ("header_timeout_s", "body_timeout_s", "keep_alive_s"):
        _positive(getattr(cfg.server, name), f"server.{name}", source)
    from hicache.modelinfo import UnknownModel, model_shape

    try:
        model_shape(cfg.model.name)
    except UnknownModel as e:
        raise ConfigError(f"{source}: model.name: {e}") from None
    _positive(cfg.model.tp_rank, "model.tp_rank", source, allow_zero=True)
    _check_tensor_parallel(cfg.model, source)
    _positive(cfg.model.cuda_graph_max_batch, "model.cuda_graph_max_batch", source, allow_zero=True)
    return cfg


def _check_tensor_parallel(m: ModelConfig, source: str) -> None:
    _positive(m.tp_size, "model.tp_size", source)
    _positive(m.tp_timeout_s, "model.tp_timeout_s", source)
    _positive(m.tp_start_timeout_s, "model.tp_start_timeout_s", source)
    if m.tp_size == 1:
        return
    if m.tp_rank:
        raise ConfigError(f"{source}: model.tp_rank: must be 0 with model.tp_size {m.tp_size} (every rank is "
                          f"started by the server, rank 0 first), got {m.tp_rank}")
    if m.device.startswith("cuda:"):
        raise ConfigError(f"{source}: model.device: {m.device!r} names one GPU, but model.tp_size {m.tp_size} puts "
                          "rank K on cuda:K (use cuda, or auto)")


def from_dict(data: dict[str, Any] | None, source: str = "<dict>") -> Config:
    """Build and validate a Config from plain data (as read from YAML)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level must be a mapping, got {type(data).__name__}")
    return validate(_build(Config, data, "", source), source)


def load_config(path: str | Path | None) -> Config:
    """Read a YAML config file (None: the defaults)."""
    if path is None:
        return validate(Config(), "<defaults>")
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config: {e.strerror or e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    return from_dict(data, str(path))


def parse_settings(settings: list[str]) -> dict[str, Any]:
    """`--set KEY=VALUE` items (serve, replay) as dotted overrides; each VALUE is parsed as YAML (numbers,
    true/false, null)."""
    out: dict[str, Any] = {}
    for item in settings:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. cache.write_policy.defer_above_free=1.0")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"--set {item!r}: the value is not valid YAML: {e}") from None
    return out


def override(cfg: Config, dotted: dict[str, Any], source: str = "command line") -> Config:
    """A copy of cfg with dotted keys (e.g. "cache.l3.path") replaced, validated again."""
    for key, value in dotted.items():
        parts = key.split(".")
        cfg = _replace_path(cfg, parts, value, key, source)
    return validate(cfg, source)


def _replace_path(obj: Any, parts: list[str], value: Any, key: str, source: str) -> Any:
    names = {f.name for f in dataclasses.fields(obj)}
    if parts[0] not in names:
        raise ConfigError(f"{source}: unknown key {key!r}")
    if len(parts) == 1:
        tp = typing.get_type_hints(type(obj))[parts[0]]
        return _construct(type(obj), {parts[0]: _convert(value, tp, key, source)}, key.rpartition(".")[0], source,
                          obj)
    child = getattr(obj, parts[0])
    return dataclasses.replace(obj, **{parts[0]: _replace_path(child, parts[1:], value, key, source)})


def set_tier_tokens(cfg: Config, tier: str, tokens: int) -> Config:
    """Size `tier` ("device", "host", "disk") in tokens, replacing its GiB size."""
    c = cfg.cache
    if tier == "disk":
        cache = dataclasses.replace(c, l3=dataclasses.replace(c.l3, size_tokens=tokens, size_gib=None))
    else:
        cache = dataclasses.replace(c, **{tier: TierSize(size_tokens=tokens)})
    return validate(dataclasses.replace(cfg, cache=cache), "command line")


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)
