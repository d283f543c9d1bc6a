"""The inference engine: model, weights, tokenizer, sampling (model half); scheduler, engine, runners, LLM.

The request-level SamplingParams (max_tokens, stop, ...) is hicache.SamplingParams (hicache.engine.params).
"""

from hicache.engine.builder import build_engine
from hicache.engine.engine import Engine
from hicache.engine.llm import LLM
from hicache.engine.model import ForwardBatch, LlamaModel, ModelConfig
from hicache.engine.request import RequestOutput, StepOutput, Usage
from hicache.engine.runner import AsyncEngine, EngineThread
from hicache.engine.sampling import SamplingParams, make_generator, sample
from hicache.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from hicache.engine.weights import DEFAULT_MODEL, load_model, model_choices

__all__ = [
    "LLM",
    "AsyncEngine",
    "Engine",
    "EngineThread",
    "RequestOutput",
    "StepOutput",
    "Usage",
    "build_engine",
    "DEFAULT_MODEL",
    "ForwardBatch",
    "IncrementalDetokenizer",
    "LlamaModel",
    "ModelConfig",
    "SamplingParams",
    "Tokenizer",
    "load_model",
    "make_generator",
    "model_choices",
    "sample",
]
