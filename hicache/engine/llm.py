"""`LLM`: the synchronous Python API. Build once from a Config, then `generate` batches of prompts."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from hicache.config import Config, load_config
from hicache.engine.builder import build_engine
from hicache.engine.engine import Engine
from hicache.engine.params import SamplingParams
from hicache.engine.request import RequestOutput

Prompt = str | list[int]


class LLM:
    """Offline generation through the full engine (continuous batching over the three-tier KV cache).

    config: a Config, a YAML path, or None for the defaults. model/tokenizer: an already loaded pair to
    reuse (must match config's model dtype and device). calibrate: time a prefill at startup when the
    cost model needs the prefill speed (cache.load_policy.prefill_tokens_per_s null, mode auto).
    """

    def __init__(
        self,
        config: Config | str | Path | None = None,
        *,
        model: Any = None,
        tokenizer: Any = None,
        calibrate: bool = True,
    ):
        cfg = config if isinstance(config, Config) else load_config(config)
        self.config = cfg
        self.engine: Engine = build_engine(cfg, model, tokenizer, calibrate)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(
        self, prompts: Prompt | list[Prompt], params: SamplingParams | dict | None = None, **kwargs: Any
    ) -> list[RequestOutput]:
        """Generate for each prompt (text or token ids) together; returns outputs in prompt order.

        kwargs override fields of `params` (temperature=0, max_tokens=32, stop=["\\n"], seed=1, ...).
        Per-request problems (e.g. more pages than the GPU pool holds) come back as finish_reason "error".
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        sampling = SamplingParams.of(params, **kwargs)
        ids = []
        for prompt in prompts:
            token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, token_ids, sampling)
            ids.append((request_id, token_ids))
        results: dict[str, RequestOutput] = {}
        pending = {request_id for request_id, _ in ids}
        tokens: dict[str, list[int]] = {request_id: [] for request_id in pending}
        text: dict[str, str] = {request_id: "" for request_id in pending}
        prompt_of = dict(ids)
        while pending:
            for out in self.engine.step():
                if out.request_id not in pending:
                    continue
                tokens[out.request_id] += out.new_token_ids
                text[out.request_id] += out.text_delta
                if out.finished:
                    pending.discard(out.request_id)
                    results[out.request_id] = RequestOutput(
                        out.request_id,
                        prompt_of[out.request_id],
                        text[out.request_id],
                        tokens[out.request_id],
                        out.finish_reason,
                        out.usage.prompt_tokens,
                        out.usage.cached_tokens,
                        out.ttft,
                        out.error,
                    )
        return [results[request_id] for request_id, _ in ids]

    def chat(
        self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]], params: Any = None, **kwargs: Any
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode_chat(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, params, **kwargs)

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        """Finish queued L3 writes and close the cache."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
