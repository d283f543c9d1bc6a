"""hicache: a three-tier (GPU / pinned host / NVMe) KV cache for LLM serving."""

from hicache.config import Config, ConfigError, load_config

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "load_config", "__version__"]
