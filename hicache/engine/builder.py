"""Build an Engine from a Config: device and dtype, the model, the prefill-speed calibration, the cache."""

from __future__ import annotations

import logging
from typing import Any

from hicache.cache import TORCH_DTYPES, build_cache
from hicache.config import Config
from hicache.engine.assembly import (
    attention_probe_sizes,
    calibrate_attention,
    calibrate_prefill,
    choose_kernels,
    engine_namespace,
    kv_layout,
    warm_up_prefix_kernel,
)
from hicache.engine.engine import Engine
from hicache.engine.weights import load_model
from hicache.modelinfo import resolve_device, resolve_dtype

logger = logging.getLogger(__name__)


def build_engine(cfg: Config, model: Any = None, tokenizer: Any = None, calibrate: bool = True) -> Engine:
    """Load the model (unless given, e.g. shared between engines in tests) and assemble the cache and engine.

    The prefill speed for the load-or-recompute cost model comes from cache.load_policy when set;
    otherwise, in auto mode with `calibrate`, from a timed prefill; otherwise None (loading counts as free).
    With model.tp_size > 1 the engine is rank 0 of a tensor-parallel group it starts (hicache.engine.tp.engine).
    """
    if cfg.model.tp_size > 1:
        if model is not None or tokenizer is not None:
            raise ValueError("a tensor-parallel engine loads its own shards: build_engine takes no model with "
                             f"model.tp_size {cfg.model.tp_size}")
        from hicache.engine.tp.engine import build_tp_engine

        return build_tp_engine(cfg, calibrate=calibrate)
    device = resolve_device(cfg.model.device)
    dtype_name = resolve_dtype(cfg.model.dtype, cfg.model.device)
    dtype = TORCH_DTYPES[dtype_name]
    if model is None or tokenizer is None:
        model, tokenizer = load_model(cfg.model.name, dtype, device)
    elif model.dtype != dtype or model.device.type != device.type:
        raise ValueError(f"the given model is {model.dtype} on {model.device}; the config asks {dtype} on {device}")
    layout = kv_layout(cfg, model, dtype)
    namespace = engine_namespace(cfg, model, dtype_name, layout)
    choose_kernels(cfg, model)
    speed = pair = None
    lp = cfg.cache.load_policy
    ps = cfg.cache.page_size
    calibrating = lp.prefill_tokens_per_s is None and lp.mode == "auto" and calibrate
    if calibrating:
        speed = calibrate_prefill(model, ps)
        logger.info("calibrated prefill speed: %.0f tokens/s", speed)
    if device.type == "cuda" and model.uses_prefill_kernel(ps):
        seconds = warm_up_prefix_kernel(model, ps)
        logger.info("prefix attention kernel warmed up in %.2f s%s", seconds,
                    "" if model.uses_prefill_kernel(ps) else " (unavailable here: SDPA instead)")
    if calibrating and lp.attention_ns_per_pair is None:  # after the warm-up: the probe runs the prefix kernel
        chunk, context = attention_probe_sizes(model, ps, speed)
        pair = calibrate_attention(model, ps, chunk, context)
        logger.info("calibrated attention cost: %.3f ns per token pair (%d-token chunk over %d tokens); a token "
                    "at 32k tokens of context costs %.2fx one at the start", pair * 1e9, chunk, context,
                    1 + 32768 * pair * speed)
    cache = build_cache(cfg, layout, dtype_name, device, namespace, prefill_tokens_per_s=speed,
                        attention_seconds_per_pair=pair)
    return Engine(model, tokenizer, cache, cfg.scheduler, cuda_graph_max_batch=cfg.model.cuda_graph_max_batch)
