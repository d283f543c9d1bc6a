"""The pieces an engine is assembled from, shared by the single-process builder (builder.py) and the
tensor-parallel ranks (tp/engine.py, tp/follower.py): the model's KV layout and cache namespace, the kernels it
uses, and the timed prefills that calibrate the cost model."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hicache.cache import namespace_fields
from hicache.config import Config
from hicache.engine.kernels import fused as fused_ops
from hicache.engine.kernels import prefill
from hicache.engine.kernels.prefill import PrefixKernelUnavailable, paged_prefix_attention
from hicache.engine.model import ForwardBatch
from tiers import KVLayout

logger = logging.getLogger(__name__)


def scratch_prefill(model: Any, page_size: int, n: int, context: int = 0) -> float:
    """Seconds of one prefill of n tokens (seeded ids, so every tensor-parallel rank runs the same batch) into a
    scratch KV pool; with `context`, a chunk of n tokens over a prefix of `context` tokens computed first (untimed)."""
    device = model.device
    pages = -(-(context + n) // page_size)
    kv = torch.zeros(model.kv_pool_shape(pages, page_size), dtype=model.dtype, device=device)
    table = [torch.arange(pages, device=device)]
    ids = torch.randint(0, model.config.vocab_size, (context + n,),
                        generator=torch.Generator().manual_seed(context + n)).to(device)

    def chunk(first: int, count: int) -> ForwardBatch:
        positions = torch.arange(first, first + count, device=device)
        return ForwardBatch(input_ids=ids[first:first + count], positions=positions, out_slots=positions,
                            seq_lens=[first + count], new_lens=[count], page_tables=table)

    if context:
        model(chunk(0, context), kv, page_size)
    batch = chunk(context, n)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    model(batch, kv, page_size)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def calibrate_prefill(model: Any, page_size: int, budget_s: float = 0.5,
                      run: Callable[[int], float] | None = None) -> float:
    """Prefill tokens per second of `model`, from a timed prefill into a scratch KV pool.

    A 32-token warm-up sizes the timed run to take about budget_s / 2 (64 to 512 tokens). `run(n)` times one
    prefill of n tokens (default `scratch_prefill`; tensor parallelism runs it on every rank at once).
    """
    if run is None:
        run = lambda n: scratch_prefill(model, page_size, n)  # noqa: E731
    if model.device.type == "cuda":  # a GPU is fast and shape-sensitive: time a serving-sized prefill after a warm-up
        n = 2048
        run(n)
        return n / min(run(n), run(n))
    run(32)
    warm = run(32)
    n = int(min(512, max(64, 32 * (budget_s / 2) / max(warm, 1e-6))))
    return n / run(n)


def calibrate_attention(model: Any, page_size: int, chunk: int, context: int,
                        run: Callable[[int, int], float] | None = None) -> float:
    """Prefill seconds per (token, earlier token) pair (CostModel.attention_seconds_per_pair): a chunk of `chunk`
    tokens timed over a prefix of `context` tokens against the same chunk with none (best of two each). Each of
    the chunk's tokens attends to `context` more tokens, so the difference over chunk * context is the price of a
    pair. `run(n, context)` times one chunk (default `scratch_prefill`). Never negative (timing noise)."""
    if run is None:
        run = lambda n, ctx: scratch_prefill(model, page_size, n, ctx)  # noqa: E731
    alone = min(run(chunk, 0), run(chunk, 0))
    deep = min(run(chunk, context), run(chunk, context))
    return max(0.0, (deep - alone) / (chunk * context))


def attention_probe_sizes(model: Any, page_size: int, speed: float, budget_s: float = 0.5,
                          max_scratch_bytes: int = 4 << 30) -> tuple[int, int]:
    """(chunk, context) tokens for `calibrate_attention`. On a GPU a serving-sized 2,048-token chunk over up to
    14,336 tokens, capped so the scratch KV stays under `max_scratch_bytes`; elsewhere a chunk the prefill speed
    runs in about budget_s / 8 over twice as many tokens of context. Both whole pages."""
    c = model.config
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * model.dtype.itemsize
    if model.device.type == "cuda":
        chunk = 2048
        context = min(14336, max_scratch_bytes // per_token - chunk)
    else:
        chunk = int(min(512, max(64, speed * budget_s / 8)))
        context = 2 * chunk
    page = lambda t: max(page_size, t // page_size * page_size)  # noqa: E731
    return page(chunk), page(context)


def warm_up_prefix_kernel(model: Any, page_size: int) -> float:
    """Run one chunk over a cached prefix through `model` in a scratch pool (one page, then one page over it), so
    that the prefix-attention kernel compiles now (seconds into an empty Triton cache) rather than in the first
    prefix hit a client sends, and a GPU it does not fit falls back to SDPA before serving. Returns seconds."""
    device = model.device
    kv = torch.zeros(model.kv_pool_shape(2, page_size), dtype=model.dtype, device=device)
    table = torch.arange(2, device=device)
    start = time.perf_counter()
    for first in (0, page_size):  # the prefix (plain causal attention), then a chunk over it (the kernel)
        positions = torch.arange(first, first + page_size, device=device)
        model(ForwardBatch(input_ids=torch.randint(0, model.config.vocab_size, (page_size,), device=device),
                           positions=positions, out_slots=positions, seq_lens=[first + page_size],
                           new_lens=[page_size], page_tables=[table]), kv, page_size)
    if device.type == "cuda" and model.prefill_kernel:
        warm_up_key_splits(model, kv[0], table, page_size)
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def warm_up_key_splits(model: Any, layer: torch.Tensor, table: torch.Tensor, page_size: int) -> int:
    """Compile the prefix kernel's split variant and the merge of each padded split count (`prefix_splits_for`),
    over one layer of a scratch pool: the first few tokens over a long prefix a client sends would otherwise wait
    for them. Returns how many split counts ran (0 where the kernel is unavailable: chunks then use SDPA)."""
    c = model.config
    q = torch.zeros(page_size, c.num_heads, c.head_dim, dtype=model.dtype, device=layer.device)
    ran = 0
    # each merge variant (a power of two of splits, up to SPLIT_MAX); more splits than keys is fine
    for splits in (1 << k for k in range(1, prefill.SPLIT_MAX.bit_length())):
        try:
            paged_prefix_attention(q, layer[0], layer[1], table, 2 * page_size, num_splits=splits)
        except PrefixKernelUnavailable:
            break
        ran += 1
    return ran


def engine_namespace(cfg: Config, model: Any, dtype_name: str, layout: KVLayout) -> dict:
    """The cache namespace of a loaded model: what changes the bytes of its pages (`namespace_fields`)."""
    fields = model.fingerprint_fields()
    revision = cfg.model.revision or str(fields.get("revision", ""))
    return {
        # a model cut to a tensor-parallel shard (hicache/engine/tp/shard.py) says which; else the config's rank
        **namespace_fields(str(fields["model"]), revision, dtype_name, layout,
                           model.tp_rank if model.tp_size > 1 else cfg.model.tp_rank, model.tp_size),
        **fields,
        "revision": revision,
    }


def kv_layout(cfg: Config, model: Any, dtype: torch.dtype) -> KVLayout:
    """What a page of this model (or of its tensor-parallel shard) holds."""
    c = model.config
    return KVLayout(c.num_layers, c.num_kv_heads, c.head_dim, cfg.cache.page_size, dtype.itemsize)


def choose_kernels(cfg: Config, model: Any) -> None:
    """The kernels the model's forward uses, as configured (process-wide for the fused elementwise ones: the last
    engine built decides; set before calibrating)."""
    fused_ops.enabled = cfg.model.fused_elementwise
    model.decode_kernel = cfg.model.decode_kernel
    model.prefill_kernel = cfg.model.prefill_attention == "triton"
