"""The inference engine: model, weights, tokenizer, sampling (model half); scheduler, engine, runners, LLM.

SamplingParams (hicache.engine.params) is a request's: the sampler's knobs (SamplerParams) plus when to stop.
Names load on first use (PEP 562): the command line registers `hicache generate` without importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "build_engine": "hicache.engine.builder",
    "Engine": "hicache.engine.engine",
    "LLM": "hicache.engine.llm",
    "ForwardBatch": "hicache.engine.model",
    "LlamaConfig": "hicache.modelinfo",
    "LlamaModel": "hicache.engine.model",
    "RequestOutput": "hicache.engine.request",
    "StepOutput": "hicache.engine.request",
    "Usage": "hicache.engine.request",
    "AsyncEngine": "hicache.engine.runner",
    "EngineThread": "hicache.engine.runner",
    "SamplingParams": "hicache.engine.params",
    "SamplerParams": "hicache.engine.params",
    "make_generator": "hicache.engine.sampling",
    "sample": "hicache.engine.sampling",
    "IncrementalDetokenizer": "hicache.engine.tokenizer",
    "Tokenizer": "hicache.engine.tokenizer",
    "DEFAULT_MODEL": "hicache.engine.weights",
    "load_model": "hicache.engine.weights",
    "model_choices": "hicache.engine.weights",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hicache.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = sorted(_LAZY)
