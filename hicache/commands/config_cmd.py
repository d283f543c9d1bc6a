"""`hicache config FILE`: validate a config file and print it resolved (tier sizes in pages and bytes)."""

from __future__ import annotations

import argparse

import yaml

from hicache.config import load_config, to_dict
from hicache.modelinfo import model_shape, resolve_dtype
from hicache.sizes import resolve_sizes


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("config", help="validate a config file and print the resolved configuration")
    p.add_argument("file", help="YAML config file")
    p.set_defaults(func=run)


SECRETS = (("server", "api_key"), ("server", "metrics_key"), ("cache.remote", "password"))
MASK = "********"


def masked(data: dict) -> dict:
    """The config as plain data with its secrets (the API key, the remote tier's password, a password inside the
    remote URL) replaced by MASK: what `hicache config` prints may end up in a log or a ticket."""
    for section, key in SECRETS:
        node = data
        for part in section.split("."):
            node = node.get(part) or {}
        if node.get(key):
            node[key] = MASK
    remote = data.get("cache", {}).get("remote") or {}
    url = remote.get("url")
    if url:
        from urllib.parse import urlsplit, urlunsplit

        parts = urlsplit(url)
        if parts.password:
            netloc = f"{parts.username or ''}:{MASK}@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
            remote["url"] = urlunsplit(parts._replace(netloc=netloc))
    return data


def describe(cfg, source: str) -> str:
    """The resolved config as YAML, followed by the tier sizes in pages, tokens and bytes."""
    shape = model_shape(cfg.model.name)
    dtype = resolve_dtype(cfg.model.dtype, cfg.model.device)
    sizes = resolve_sizes(cfg, shape.kv_bytes_per_token(dtype))
    lines = [f"# {source}: valid", yaml.safe_dump(masked(to_dict(cfg)), sort_keys=False).rstrip(), "", "# resolved"]
    lines.append(f"model: {shape.name} ({shape.num_layers} layers, {shape.num_kv_heads} KV heads, "
                 f"head dim {shape.head_dim}), dtype {dtype}")
    lines.append(f"page: {sizes.page_size} tokens = {sizes.page_bytes} bytes "
                 f"({shape.kv_bytes_per_token(dtype)} bytes/token)")
    for tier in ("device", "host", "disk"):
        pages = getattr(sizes, f"{tier}_pages")
        state = "" if pages else "  (disabled)"
        lines.append(f"{tier:>6}: {pages} pages, {sizes.tokens(tier)} tokens, "
                     f"{sizes.bytes(tier) / (1 << 30):.3f} GiB{state}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.file)
    print(describe(cfg, args.file))
    return 0
