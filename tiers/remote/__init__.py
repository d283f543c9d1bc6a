"""The remote tier: pages in a store many hicache servers share (docs/remote-tier.md). `RemoteStore` is what
every backend shares (base.py); `ValkeyStore` speaks to Valkey or Redis (valkey.py), `MooncakeStore` to a
Mooncake cluster (mooncake.py, the `mooncake` extra). tiers/persistent.py picks one by `cache.remote.url`."""

from tiers.remote.base import HEADER_BYTES, RemoteError, RemoteStore

__all__ = ["HEADER_BYTES", "RemoteError", "RemoteStore"]
