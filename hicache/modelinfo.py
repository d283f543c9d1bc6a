"""A model's architecture without its weights: the Llama-family hyperparameters (LlamaConfig), the random-weight
presets of real shapes, and the KV shape that sizes the tiers and namespaces the cache."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# The embedded model's shape (its GGUF is not opened just to size tiers); random:<preset> shapes come
# from the engine's presets.
BUILTIN_SHAPES: dict[str, tuple[int, int, int, int]] = {
    # name: (layers, kv heads, head dim, max context)
    "smollm2-135m-instruct": (30, 3, 64, 8192),
}


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-family model; `name` and `revision` identify the weights."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "unnamed"
    revision: str = "unknown"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ("llama3", "default"):
            raise ValueError(f"unsupported rope_scaling {self.rope_scaling}; supported: llama3")

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], name: str = "unnamed", revision: str = "unknown"
    ) -> LlamaConfig:
        """Read a Hugging Face config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "qwen2", "mistral"):
            raise ValueError(f"unsupported model_type {model_type!r}; supported: llama, qwen2, mistral")
        if hf.get("mlp_bias"):
            raise ValueError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_scaling = None
        if rope_type != "default":
            rope_scaling = {**rope, "rope_type": rope_type}
            rope_scaling.pop("type", None)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        num_heads = hf["num_attention_heads"]
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            revision=revision,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The config.json dict `from_hf_config` reads back (used for converted-model caches)."""
        rope: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
        rope.update(self.rope_scaling or {})
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids),
        }

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V over all layers for one token."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def fingerprint_fields(self, dtype: torch.dtype) -> dict[str, str | int]:
        """Everything about the model that changes KV bytes: the KV cache's namespace."""
        return {
            "model": self.name,
            "revision": self.revision,
            "dtype": str(dtype).removeprefix("torch."),
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
        }


_LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
RANDOM_PRESETS: dict[str, LlamaConfig] = {
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": LlamaConfig(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28, num_heads=28,
        num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        attention_bias=True,
    ),
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=16, rope_theta=10000.0, max_position_embeddings=2048,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_context: int

    def kv_bytes_per_token(self, dtype: str) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * DTYPE_BYTES[dtype]


class UnknownModel(ValueError):
    """A model name that is neither built in, nor a random preset, nor a Hugging Face model directory."""


def model_shape(name: str) -> ModelShape:
    """Shape of a built-in model or a Hugging Face directory (config.json); UnknownModel if unknown."""
    if name in BUILTIN_SHAPES:
        return ModelShape(name, *BUILTIN_SHAPES[name])
    if name.startswith("random:"):
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
    presets = ", ".join(f"random:{p}" for p in sorted(RANDOM_PRESETS))
    raise UnknownModel(f"unknown model {name!r}: use {', '.join(sorted(BUILTIN_SHAPES))}, a preset of random "
                       f"weights ({presets}) or a Hugging Face model directory (one holding config.json)")


def resolve_dtype(dtype: str, device: str) -> str:
    """'auto' -> bfloat16 on CUDA, float32 on CPU. Imports no torch (sizing tiers for the replay tool needs none)."""
    if dtype != "auto":
        return dtype
    on_cuda = device.startswith("cuda") or (device == "auto" and cuda_available())
    return "bfloat16" if on_cuda else "float32"


def cuda_available() -> bool:
    """Whether a CUDA device is usable, as `torch.cuda.is_available()` says, without importing torch where it is
    not loaded yet: the CUDA driver is asked through ctypes (it honours CUDA_VISIBLE_DEVICES as torch does)."""
    import sys

    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.is_available()
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return lib.cuInit(0) == 0 and lib.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def resolve_device(device: str) -> torch.device:
    import torch  # here, not at the top: sizing tiers (the replay tool) needs no torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
