"""KV shape of a model without loading its weights: for sizing tiers and namespacing the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The embedded model's shape (its GGUF is not opened just to size tiers); random:<preset> shapes come
# from the engine's presets.
BUILTIN_SHAPES: dict[str, tuple[int, int, int, int]] = {
    # name: (layers, kv heads, head dim, max context)
    "smollm2-135m-instruct": (30, 3, 64, 8192),
}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


def model_shape(name: str) -> ModelShape:
    """Shape of a built-in model or a Hugging Face directory (config.json); ValueError if unknown."""
    if name in BUILTIN_SHAPES:
        return ModelShape(name, *BUILTIN_SHAPES[name])
    if name.startswith("random:"):
        from hicache.engine.weights import RANDOM_PRESETS

        preset = RANDOM_PRESETS.get(name.removeprefix("random:"))
        if preset is not None:
            return ModelShape(name, preset.num_layers, preset.num_kv_heads, preset.head_dim,
                              preset.max_position_embeddings)
    config = Path(name) / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        heads = c["num_attention_heads"]
        head_dim = c.get("head_dim") or c["hidden_size"] // heads
        return ModelShape(
            name, c["num_hidden_layers"], c.get("num_key_value_heads", heads), head_dim,
            c.get("max_position_embeddings", 4096),
        )
    raise ValueError(
        f"unknown model {name!r}: use {', '.join(sorted(BUILTIN_SHAPES))}, random:<preset> "
        "or a Hugging Face model directory"
    )


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bfloat16 on CUDA, float32 on CPU."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if resolve_device(device).type == "cuda" else "float32"


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
