"""Per-request generation parameters: the sampler's knobs (SamplerParams) plus when to stop. No torch here: the
HTTP edge and the command line build them without it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily (vLLM draws the same line)


@dataclass(frozen=True)
class SamplerParams:
    """How one request picks its next token. temperature 0 is greedy; top_k -1 and top_p 1 disable them.

    Invalid values raise ValueError naming the parameter.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if (
            not isinstance(self.top_k, int)
            or isinstance(self.top_k, bool)
            or self.top_k < -1
            or self.top_k == 0
        ):
            raise ValueError(f"top_k must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0
        ):
            raise ValueError(f"seed must be a non-negative integer or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """temperature 0 (or below GREEDY_BELOW, where logits / temperature overflow to garbage) or top_k 1."""
        return self.temperature < GREEDY_BELOW or self.top_k == 1


@dataclass(frozen=True)
class SamplingParams(SamplerParams):
    """How one request samples and when it stops; usable wherever `SamplerParams` is.

    max_tokens None means the scheduler's default_max_tokens; `stop` strings end generation when the
    decoded text contains one (the stop string itself is trimmed); `stop_token_ids` (and the model's
    EOS ids unless ignore_eos) end it when sampled. Before `min_tokens` tokens those ids are never sampled and
    no stop string ends it (vLLM's rule). Invalid values raise ValueError naming the field.
    """

    max_tokens: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        object.__setattr__(self, "stop", stop)
        ids = tuple(self.stop_token_ids or ())
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be a positive integer or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")

    @classmethod
    def of(cls, params: SamplerParams | dict[str, Any] | None = None, **kwargs: Any) -> SamplingParams:
        """Coerce `params` (ours, the sampler's, a dict or None) plus keyword overrides into SamplingParams."""
        values: dict[str, Any] = {}
        if isinstance(params, SamplerParams):
            values = {f.name: getattr(params, f.name) for f in fields(params)}
        elif isinstance(params, dict):
            values = dict(params)
        elif params is not None:
            raise TypeError(f"expected SamplingParams or a dict, got {type(params).__name__}")
        values.update(kwargs)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; allowed: {sorted(names)}")
        return cls(**values)
