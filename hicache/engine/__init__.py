"""The inference engine: model, weights, tokenizer, sampling (model half); scheduler, engine, runners, LLM.

SamplingParams (hicache.engine.params) is a request's: the sampler's knobs (SamplerParams) plus when to stop.
"""

from hicache.engine.builder import build_engine
from hicache.engine.engine import Engine
from hicache.engine.llm import LLM
from hicache.engine.model import ForwardBatch, LlamaConfig, LlamaModel
from hicache.engine.params import SamplingParams
from hicache.engine.request import RequestOutput, StepOutput, Usage
from hicache.engine.runner import AsyncEngine, EngineThread
from hicache.engine.sampling import SamplerParams, make_generator, sample
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
    "LlamaConfig",
    "SamplerParams",
    "SamplingParams",
    "Tokenizer",
    "load_model",
    "make_generator",
    "model_choices",
    "sample",
]
