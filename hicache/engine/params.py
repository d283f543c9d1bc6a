"""Per-request generation parameters: the sampler's knobs plus when to stop."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from hicache.engine import sampling


@dataclass(frozen=True)
class SamplingParams(sampling.SamplerParams):
    """How one request samples and when it stops; usable wherever `sampling.SamplerParams` is.

    max_tokens None means the scheduler's default_max_tokens; `stop` strings end generation when the
    decoded text contains one (the stop string itself is trimmed); `stop_token_ids` (and the model's
    EOS ids unless ignore_eos) end it when sampled. Invalid values raise ValueError naming the field.
    """

    max_tokens: int | None = None
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

    @classmethod
    def of(cls, params: sampling.SamplerParams | dict[str, Any] | None = None, **kwargs: Any) -> SamplingParams:
        """Coerce `params` (ours, the sampler's, a dict or None) plus keyword overrides into SamplingParams."""
        values: dict[str, Any] = {}
        if isinstance(params, sampling.SamplerParams):
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
