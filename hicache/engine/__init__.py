"""The model half of the inference engine: model, weights, tokenizer, sampling."""

from hicache.engine.model import ForwardBatch, LlamaModel, ModelConfig
from hicache.engine.sampling import SamplingParams, make_generator, sample
from hicache.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from hicache.engine.weights import DEFAULT_MODEL, load_model, model_choices

__all__ = [
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
