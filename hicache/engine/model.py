"""Llama-architecture decoder (Llama 2/3, SmolLM2, Qwen2) in plain PyTorch over a paged KV pool.

The model owns weights only. KV lives in the pool tensor passed to `forward`:
``kv[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Parameter names follow Hugging Face's without the leading ``model.``, so HF checkpoints load as-is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hicache.engine.attention import paged_attention, plan_attention


@dataclass(frozen=True)
class ModelConfig:
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
    ) -> ModelConfig:
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


@dataclass
class ForwardBatch:
    """A ragged batch: each sequence has some cached tokens (already in the pool) and some new ones."""

    input_ids: Tensor  # [T] new tokens of all sequences concatenated (int64)
    positions: Tensor  # [T] absolute position of each new token
    out_slots: Tensor  # [T] flat KV slot where each new token's K/V is written
    seq_lens: list[int]  # per sequence: total length after this step (cached + new)
    new_lens: list[int]  # per sequence: number of new tokens in this step
    page_tables: list[Tensor] = field(default_factory=list)  # per sequence: page ids, int64 on device


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with Llama-3 long-context scaling if configured."""
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type") == "default":
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed by `factor`, short ones kept, the band between interpolated smoothly
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] by position (half-split layout, as HF). cos/sin: [T, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, reading and writing one layer of the paged KV pool."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_layer: Tensor, out_slots: Tensor, plan
    ) -> Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, kv_layer, out_slots, plan)
        return self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_layer: Tensor, out_slots: Tensor, plan
    ) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_layer, out_slots, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Decoder-only Llama-family model; build on the meta device, then `load_state_dict(..., assign=True)`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        )
        self._inv_freq = rope_inv_freq(config)  # plain CPU tensor (not a buffer): survives meta construction

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def kv_pool_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """Shape of the KV pool tensor this model reads and writes."""
        c = self.config
        return (c.num_layers, 2, num_pages, page_size, c.num_kv_heads, c.head_dim)

    def fingerprint_fields(self) -> dict[str, str | int]:
        """The KV cache namespace for this model at its current dtype."""
        return self.config.fingerprint_fields(self.dtype)

    def _rope_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim]
        return angles.cos().to(dtype), angles.sin().to(dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: Tensor, page_size: int, all_logits: bool = False) -> Tensor:
        """Run the new tokens of every sequence, writing their K/V into `kv` at `batch.out_slots`.

        Returns float32 logits of the last new token of each sequence, [num_seqs, vocab], or of every
        new token, [T, vocab], when `all_logits`.
        """
        expected = self.config.num_layers, 2
        if tuple(kv.shape[:2]) != expected or kv.shape[3] != page_size:
            raise ValueError(
                f"kv pool shape {tuple(kv.shape)} does not match model layers/page_size {page_size}"
            )
        plan = plan_attention(batch.positions, batch.seq_lens, batch.new_lens, batch.page_tables, page_size)
        cos, sin = self._rope_cos_sin(batch.positions, self.dtype)
        x = self.embed_tokens(batch.input_ids)
        for layer_index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv[layer_index], batch.out_slots, plan)
        if not all_logits:
            last_rows = torch.tensor(batch.new_lens, device=x.device).cumsum(0) - 1
            x = x[last_rows]
        x = self.norm(x)
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()
