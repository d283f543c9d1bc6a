"""Tenants: who a request is (by its API key) and which part of the cache it may match and fill.

A shared prefix cache is a side channel: a client that sends a guess of another user's prompt learns from
`cached_tokens`, or from a fast first token, whether someone sent it. So every request runs in a cache
namespace (radix.namespace), and prefixes match only within one, on every tier:

- a tenant's requests are in the tenant's namespace, whatever they send;
- tenants marked `shared`, and the server's own `--api-key`, share the default namespace (the one a server
  without tenants uses, so an L3 written before tenants were configured still matches there);
- a request's `cache_salt` (as vLLM accepts it) makes a namespace of its own inside its tenant's: requests
  match only requests with the same salt.

The namespace id is a hash of the tenant's name and the salt: neither the salt nor a key is kept or logged.

Each tenant that is not shared is a share group with a fraction of every tier (`share`, or an equal part of
what the explicit shares leave); the shared namespace is group 0 with the same. A tier that must make room
takes it from the groups over their share first (radix.order), so a tenant that floods the cache evicts its
own pages and not another's hot prefix.

The tenants file (`server.tenants_file`, `hicache serve --tenants FILE`) is YAML:

    tenants:
      alice: {keys: [sk-alice-1, sk-alice-2], share: 0.4}
      bob: {keys: [sk-bob]}
      ops: {keys: [sk-ops], shared: true}
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hicache.config import ConfigError
from radix import DEFAULT_NAMESPACE, CacheNamespace, namespace_id

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
SHARED_GROUP = 0
SHARED_NAME = "shared"  # the metrics label of the shared namespace's pages
DEFAULT_TENANT = "default"  # the tenant of the server's own --api-key, or of every request without tenants
MAX_SALT_CHARS = 1024


class TenantsError(ConfigError):
    """A tenants file that cannot be used; the message names the file and what is wrong."""


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[bytes, ...]  # UTF-8
    shared: bool = False
    share: float | None = None  # fraction of each tier; None: an equal part of what the explicit shares leave
    group: int = SHARED_GROUP

    def __repr__(self) -> str:  # never the keys
        return f"Tenant({self.name!r}, shared={self.shared}, group={self.group})"


class Tenants:
    """The tenants a server knows and their keys. Without a tenants file there is one tenant, "default", in the
    shared namespace, with the server's `--api-key` (or none: then every request is it)."""

    def __init__(self, tenants: Sequence[Tenant], open_access: bool):
        self.tenants = list(tenants)
        self.open_access = open_access  # no key at all: every request is the default tenant
        self._keys = [(key, t) for t in self.tenants for key in t.keys]

    @classmethod
    def build(cls, api_key: str | None, tenants_file: str | None) -> Tenants:
        """The server's tenants from its `--api-key` and tenants file (either may be absent)."""
        tenants = load_tenants_file(tenants_file) if tenants_file else []
        if api_key is not None:
            if not api_key.strip():
                raise TenantsError("the API key is empty: an empty key would let every request in")
            if any(t.name == DEFAULT_TENANT for t in tenants):
                raise TenantsError(f"{tenants_file}: the tenant name {DEFAULT_TENANT!r} is the one --api-key's "
                                   "key gets; name the tenant otherwise")
            tenants.insert(0, Tenant(DEFAULT_TENANT, (api_key.encode("utf-8"),), shared=True))
        keys = [k for t in tenants for k in t.keys]
        if len(set(keys)) != len(keys):
            raise TenantsError(f"{tenants_file}: a key is given to more than one tenant (or is --api-key's too)")
        if not tenants:
            return cls([Tenant(DEFAULT_TENANT, (), shared=True)], open_access=True)
        return cls(tenants, open_access=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    @property
    def auth_required(self) -> bool:
        return not self.open_access

    @property
    def isolated(self) -> bool:
        """Whether any tenant has a namespace of its own."""
        return any(not t.shared for t in self.tenants)

    def authenticate(self, header: str) -> Tenant | None:
        """The tenant whose key an Authorization header carries (`Bearer <key>`, the scheme in any case, RFC
        7235), or None. The header's bytes (the server hands them over decoded as Latin-1) are compared with each
        key's UTF-8 bytes, every key in constant time, so the time taken says nothing of which key nearly
        matched. Without keys every request is the default tenant."""
        if self.open_access:
            return self.tenants[0]
        raw = _bearer_token(header)
        if raw is None:
            return None
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(raw, key) and found is None:
                found = tenant
        return found

    def may_see_tenant_series(self, header: str, metrics_key: str | None) -> bool:
        """Whether a /metrics scrape with this Authorization header may see the per-tenant series: on an open
        server anyone (one tenant, whose figures are the server's); with API keys only a bearer of `metrics_key`
        (none set: nobody), as each tenant's counters would tell one tenant what another sent and hit."""
        if self.open_access:
            return True
        raw = _bearer_token(header)
        return bool(metrics_key) and raw is not None and hmac.compare_digest(raw, metrics_key.encode("utf-8"))

    @staticmethod
    def namespace(tenant: Tenant, salt: str | None) -> CacheNamespace:
        """The cache namespace of a request of `tenant` with `cache_salt` `salt`."""
        if tenant.shared:
            return DEFAULT_NAMESPACE if salt is None else CacheNamespace(namespace_id("salt", salt), SHARED_GROUP)
        parts = ("tenant", tenant.name) if salt is None else ("tenant", tenant.name, "salt", salt)
        return CacheNamespace(namespace_id(*parts), tenant.group)

    def shares(self) -> dict[int, float]:
        """Each share group's fraction of every tier ({} with a single group: nothing to share)."""
        own = [t for t in self.tenants if not t.shared]
        if not own:
            return {}
        groups: dict[int, float | None] = {t.group: t.share for t in own}
        if any(t.shared for t in self.tenants):
            groups[SHARED_GROUP] = None
        fixed = sum(s for s in groups.values() if s is not None)
        rest = [g for g, s in groups.items() if s is None]
        each = max(0.0, 1.0 - fixed) / len(rest) if rest else 0.0
        return {g: (s if s is not None else each) for g, s in groups.items()}

    def group_names(self) -> dict[int, str]:
        """The metrics label of each share group: its tenant's name, "shared" for the shared namespace."""
        names = {SHARED_GROUP: SHARED_NAME if self.isolated else DEFAULT_TENANT}
        names.update({t.group: t.name for t in self.tenants if not t.shared})
        return names


def _bearer_token(header: str) -> bytes | None:
    """The token of an Authorization header's `Bearer <token>` (the scheme in any case, RFC 7235) as the bytes the
    client sent (the server hands headers over decoded as Latin-1); None for another scheme, no token (an empty
    token is no key, whatever keys were configured) or characters no header carries."""
    scheme, _, token = header.partition(" ")
    try:
        raw = token.strip().encode("latin-1")
    except UnicodeEncodeError:
        return None
    return raw if raw and scheme.lower() == "bearer" else None


class _UniqueKeys(yaml.SafeLoader):
    """safe_load that refuses a key given twice in one mapping (a tenant named twice would silently replace the
    first, and its keys with it), naming the line."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                repeated = key in seen
            except TypeError:  # an unhashable key: the constructor below says so
                continue
            if repeated:
                raise yaml.constructor.ConstructorError(None, None, f"{key!r} is given twice", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_tenants_file(path: str) -> list[Tenant]:
    """Parse a tenants file (see the module doc); TenantsError names what is wrong."""
    try:
        data = yaml.load(Path(path).read_text(encoding="utf-8"), Loader=_UniqueKeys)  # noqa: S506 (a SafeLoader)
    except OSError as e:
        raise TenantsError(f"cannot read the tenants file {path}: {e.strerror or e}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise TenantsError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, Mapping) or set(data) != {"tenants"} or not isinstance(data["tenants"], Mapping):
        raise TenantsError(f"{path}: expected one top-level key 'tenants' mapping each tenant's name to its "
                           "keys, e.g. 'tenants: {alice: {keys: [sk-...]}}'")
    tenants = []
    for group, (name, spec) in enumerate(data["tenants"].items(), start=1):
        tenants.append(_tenant(path, name, spec, group))
    if not tenants:
        raise TenantsError(f"{path}: no tenants")
    shares = [t.share for t in tenants if t.share is not None]
    if sum(shares) > 1.0 + 1e-9:
        raise TenantsError(f"{path}: the shares add up to {sum(shares):g}, more than 1")
    return tenants


def _tenant(path: str, name: Any, spec: Any, group: int) -> Tenant:
    where = f"{path}: tenant {name!r}"
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise TenantsError(f"{where}: a name is 1-64 letters, digits, '_', '.' or '-' (it labels metrics)")
    if not isinstance(spec, Mapping):
        raise TenantsError(f"{where}: expected a mapping with 'keys' (and optionally 'share', 'shared')")
    unknown = sorted(set(spec) - {"keys", "share", "shared"})
    if unknown:
        raise TenantsError(f"{where}: unknown field(s) {unknown}; allowed: keys, share, shared")
    keys = spec.get("keys")
    if (not isinstance(keys, list) or not keys
            or not all(isinstance(k, str) and k and k == k.strip() and "\n" not in k for k in keys)):
        raise TenantsError(f"{where}: 'keys' must be a non-empty list of non-empty strings without surrounding "
                           "spaces")
    shared = spec.get("shared", False)
    if not isinstance(shared, bool):
        raise TenantsError(f"{where}: 'shared' must be true or false")
    share = spec.get("share")
    if share is not None:
        if shared:
            raise TenantsError(f"{where}: a shared tenant has no share of its own (it shares the shared namespace's)")
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 < share <= 1.0:
            raise TenantsError(f"{where}: 'share' must be a number in (0, 1], the fraction of each tier it keeps "
                               "when tiers are contended")
        share = float(share)
    return Tenant(name, tuple(k.encode("utf-8") for k in keys), shared, share, SHARED_GROUP if shared else group)
