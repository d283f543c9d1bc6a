"""Llama-architecture decoder (Llama 2/3, SmolLM2, Qwen2) in plain PyTorch over a paged KV pool.

The model owns weights only. KV lives in the pool tensor passed to `forward`:
``kv[num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]`` (0 = K, 1 = V).
Parameter names follow Hugging Face's without the leading ``model.``, so HF checkpoints load as-is; the
loaders then call `LlamaModel.fuse_projections` (one qkv and one gate/up GEMM per layer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hicache.engine.attention import DecodePlan, paged_attention, plan_attention
from hicache.engine.kernels import fused as fused_ops
from hicache.engine.kernels.decode import kernel_supported
from hicache.engine.kernels.prefill import prefix_kernel_available
from hicache.modelinfo import LlamaConfig


@dataclass
class ForwardBatch:
    """A ragged batch: each sequence has some cached tokens (already in the pool) and some new ones."""

    input_ids: Tensor  # [T] new tokens of all sequences concatenated (int64)
    positions: Tensor  # [T] absolute position of each new token
    out_slots: Tensor  # [T] flat KV slot where each new token's K/V is written
    seq_lens: list[int]  # per sequence: total length after this step (cached + new)
    new_lens: list[int]  # per sequence: number of new tokens in this step
    page_tables: list[Tensor] = field(default_factory=list)  # per sequence: page ids, int64 on device
    # Optional, int64 on device: the row of each decode sequence's (new_len 1) token, those sequences' seq_lens,
    # and the row of each sequence's last new token. Built here from the lists when absent; the engine passes
    # them in its one upload per step, since a separate small copy on CUDA waits behind the copy engine's queue
    # of page loads (see hicache.engine.host_io) and blocks the host until they land.
    decode_rows: Tensor | None = None
    decode_lens: Tensor | None = None
    last_rows: Tensor | None = None


def rope_inv_freq(config: LlamaConfig) -> Tensor:
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


def apply_rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [T, heads, head_dim] in place by position (half-split layout, as HF); returns x.

    cos: [T, 1, head_dim] as HF's; sin: [T, 1, head_dim] with its first half negated (see `rope_cos_sin`), so
    that HF's ``x * cos + cat(-x2, x1) * sin`` becomes ``x * cos + cat(x2, x1) * sin``: on CUDA one Triton kernel
    (`hicache.engine.kernels.fused.rope_`), elsewhere one copy and two elementwise kernels. x may be a strided view (the
    q and k heads of a fused qkv projection).
    """
    return fused_ops.rope_(x, cos, sin)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and half-negated sin [T, 1, head_dim] in `dtype` for `apply_rope_`, computed in float32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]
    sin = torch.cat((-sin, sin), dim=-1)[:, None, :]
    return cos.to(dtype), sin.to(dtype)


def _fused_linear(parts: list[nn.Linear]) -> nn.Linear:
    """One Linear whose output is the concatenation of `parts`' outputs (weights and biases concatenated)."""
    has_bias = parts[0].bias is not None
    if any((p.bias is not None) != has_bias for p in parts):
        raise ValueError("cannot fuse projections with and without bias")
    weight = torch.cat([p.weight.detach() for p in parts])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta", dtype=weight.dtype)
    requires_grad = parts[0].weight.requires_grad
    fused.weight = nn.Parameter(weight, requires_grad=requires_grad)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=requires_grad)
    return fused


def _add_linear_(residual: Tensor, x: Tensor, linear: nn.Linear, reduce=None) -> Tensor:
    """residual += linear(x) in place, the add fused into the matmul (beta=1 GEMM); linear has no bias.

    `reduce`: under tensor parallelism (hicache/engine/tp/shard.py) linear(x) is this rank's partial sum, summed over
    the ranks before it is added."""
    if reduce is None:
        return residual.addmm_(x, linear.weight.t())
    return residual.add_(reduce(x @ linear.weight.t()))


class RMSNorm(nn.Module):
    """Root-mean-square norm, statistics in float32 (`F.rms_norm`: one fused kernel on CUDA).

    In float32 this is HF's LlamaRMSNorm. In bf16/fp16 the weight is applied before the single rounding to
    the input dtype, where HF rounds the normalised value first: the two differ by bf16 rounding.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE, reading and writing one layer of the paged KV pool.

    Loads with HF's separate q/k/v projections; `fuse` replaces them with one `qkv_proj`.
    """

    def __init__(self, config: LlamaConfig) -> None:
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
        self.qkv_proj: nn.Linear | None = None
        self.reduce = None  # tensor parallel: the all-reduce of o_proj's partial sums (hicache/engine/tp/shard.py)

    def fuse(self) -> None:
        """Replace q_proj, k_proj, v_proj by one qkv_proj (rows q, then k, then v); no-op once fused."""
        if self.qkv_proj is None:
            self.qkv_proj = _fused_linear([self.q_proj, self.k_proj, self.v_proj])
            self.q_proj = self.k_proj = self.v_proj = None

    def forward(
        self, x: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, kv_layer: Tensor, out_slots: Tensor, plan
    ) -> Tensor:
        """Add the attention output of x (normed) to `residual` in place and return it."""
        tokens = x.shape[0]
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x)
        else:
            qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        qkv = qkv.view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        apply_rope_(qkv[:, : self.num_heads + self.num_kv_heads], cos, sin)  # q and k heads in one pass
        q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, kv_layer, out_slots, plan)
        return _add_linear_(residual, out.reshape(tokens, self.num_heads * self.head_dim), self.o_proj, self.reduce)


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)). `fuse` replaces gate_proj and up_proj by gate_up_proj."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Linear | None = None
        self.reduce = None  # tensor parallel: the all-reduce of down_proj's partial sums

    def fuse(self) -> None:
        """Replace gate_proj and up_proj by one gate_up_proj (rows gate, then up); no-op once fused."""
        if self.gate_up_proj is None:
            self.gate_up_proj = _fused_linear([self.gate_proj, self.up_proj])
            self.gate_proj = self.up_proj = None

    def forward(self, x: Tensor, residual: Tensor) -> Tensor:
        """Add the feed-forward output of x (normed) to `residual` in place and return it."""
        if self.gate_up_proj is not None:
            act = fused_ops.silu_and_mul(self.gate_up_proj(x))  # one kernel on CUDA
        else:
            act = F.silu(self.gate_proj(x), inplace=True).mul_(self.up_proj(x))
        return _add_linear_(residual, act, self.down_proj, self.reduce)


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)), both added to x in place."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, kv_layer: Tensor, out_slots: Tensor, plan
    ) -> Tensor:
        x = self.self_attn(self.input_layernorm(x), x, cos, sin, kv_layer, out_slots, plan)
        return self.mlp(self.post_attention_layernorm(x), x)


class LlamaModel(nn.Module):
    """Decoder-only Llama-family model.

    Build on the meta device, `load_state_dict(..., assign=True)` (HF names), then `fuse_projections()`.
    """

    def __init__(self, config: LlamaConfig) -> None:
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
        self.head_shard: Tensor | None = None  # tensor parallel: this rank's vocabulary rows of the LM head
        self.gather_logits = None  # ... and the all-gather of every rank's logits
        self.tp_rank, self.tp_size = 0, 1
        self.decode_kernel = True  # use the Triton paged decode kernel where it runs (False: the reference)
        self.prefill_kernel = False  # chunks over a cached prefix: the Triton prefix kernel where it runs

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

    def fuse_projections(self) -> LlamaModel:
        """Concatenate each layer's q/k/v projections into one `qkv_proj` and gate/up into one `gate_up_proj`.

        Called by the loaders once the checkpoint (HF parameter names) is loaded; the separate weights are
        released, so `state_dict()` afterwards has the fused names. Same results as unfused up to the matmul's
        rounding; fewer, larger GEMMs. Idempotent; returns self.
        """
        with torch.no_grad():
            for layer in self.layers:
                layer.self_attn.fuse()
                layer.mlp.fuse()
        if self.device.type == "cuda":  # hand the released separate weights' cached blocks back to the driver
            torch.cuda.empty_cache()
        return self

    def _rope_cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._inv_freq.device != positions.device:
            self._inv_freq = self._inv_freq.to(positions.device)
        return rope_cos_sin(self._inv_freq, positions, dtype)

    def uses_decode_kernel(self, page_size: int) -> bool:
        """Whether decode tokens go through the paged Triton kernel (else gather + SDPA)."""
        return self.decode_kernel and kernel_supported(self.device, page_size, self.config.head_dim)

    def uses_prefill_kernel(self, page_size: int) -> bool:
        """Whether prefill chunks over a cached prefix go through the paged Triton kernel (else gather + SDPA)."""
        return (self.prefill_kernel and prefix_kernel_available(self.device)
                and kernel_supported(self.device, page_size, self.config.head_dim))

    def _check_pool(self, kv: Tensor, page_size: int) -> None:
        expected = self.config.num_layers, 2
        if tuple(kv.shape[:2]) != expected or kv.shape[3] != page_size:
            raise ValueError(
                f"kv pool shape {tuple(kv.shape)} does not match model layers/page_size {page_size}"
            )

    def _layers(self, input_ids: Tensor, positions: Tensor, out_slots: Tensor, plan, kv: Tensor,
                before_layer: Callable[[int], None] | None = None) -> Tensor:
        cos, sin = self._rope_cos_sin(positions, self.dtype)
        x = self.embed_tokens(input_ids)
        for layer_index, layer in enumerate(self.layers):
            if before_layer is not None:  # the layer's cached KV may still be loading (tiers/layered_copy.py)
                before_layer(layer_index)
            x = layer(x, cos, sin, kv[layer_index], out_slots, plan)
        return x

    def _logits(self, x: Tensor) -> Tensor:
        x = self.norm(x)
        if self.head_shard is not None:
            return self.gather_logits(F.linear(x, self.head_shard).float())
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(x, head).float()

    @torch.inference_mode()
    def decode_forward(
        self, input_ids: Tensor, positions: Tensor, out_slots: Tensor, plan: DecodePlan, kv: Tensor
    ) -> Tensor:
        """One decode token per sequence (row i = sequence i) through the paged kernel; float32 logits [D, vocab].

        Every input is a device tensor and nothing syncs with the host, so CUDA graphs can capture it
        (`hicache.engine.cuda_graph`). Needs `uses_decode_kernel(page_size)`.
        """
        self._check_pool(kv, kv.shape[3])
        return self._logits(self._layers(input_ids, positions, out_slots, plan, kv))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv: Tensor, page_size: int, all_logits: bool = False,
                before_layer: Callable[[int], None] | None = None) -> Tensor:
        """Run the new tokens of every sequence, writing their K/V into `kv` at `batch.out_slots`. `before_layer`,
        called with each layer's index before it runs, makes the GPU wait for that layer's cached KV
        (`tiers.layered_copy.layer_waits`).

        The residual stream is updated in place (inference only).

        Returns float32 logits of the last new token of each sequence, [num_seqs, vocab], or of every
        new token, [T, vocab], when `all_logits`.
        """
        self._check_pool(kv, page_size)
        plan = plan_attention(
            batch.positions, batch.seq_lens, batch.new_lens, batch.page_tables, page_size,
            decode_kernel=self.uses_decode_kernel(page_size), decode_rows=batch.decode_rows,
            decode_lens=batch.decode_lens, prefill_kernel=self.uses_prefill_kernel(page_size),
        )
        x = self._layers(batch.input_ids, batch.positions, batch.out_slots, plan, kv, before_layer)
        if not all_logits:
            last_rows = batch.last_rows
            if last_rows is None:
                last_rows = torch.tensor(batch.new_lens, device=x.device).cumsum(0) - 1
            x = x[last_rows]
        return self._logits(x)
