"""hicache: a three-tier (GPU / pinned host / NVMe) KV cache for LLM serving."""

from hicache.config import Config, ConfigError, load_config

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "load_config", "__version__", "LLM", "SamplingParams", "Engine", "AsyncEngine",
           "EngineThread", "RequestOutput", "StepOutput"]

# the engine needs torch and the model code: imported on first use, not at `import hicache`
_LAZY = {
    "LLM": "hicache.engine.llm",
    "SamplingParams": "hicache.engine.params",
    "Engine": "hicache.engine.engine",
    "AsyncEngine": "hicache.engine.runner",
    "EngineThread": "hicache.engine.runner",
    "RequestOutput": "hicache.engine.request",
    "StepOutput": "hicache.engine.request",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hicache' has no attribute {name!r}")
