"""A minimal generation loop without the scheduler: one private KV pool, contiguous pages.

For tests, benchmarks and smoke checks; serving goes through the scheduler, which owns the pool.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hicache.engine.model import ForwardBatch, LlamaModel
from hicache.engine.params import SamplerParams
from hicache.engine.sampling import make_generator, sample


def allocate_kv(model: LlamaModel, num_pages: int, page_size: int) -> Tensor:
    """A zeroed KV pool tensor for `model` on its device and dtype."""
    return torch.zeros(model.kv_pool_shape(num_pages, page_size), dtype=model.dtype, device=model.device)


def generate(
    model: LlamaModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    params: SamplerParams | None = None,
    page_size: int = 16,
    stop_ids: list[int] | None = None,
) -> list[list[int]]:
    """Prefill every prompt (one batch), then decode them together; returns the generated ids per prompt.

    A sequence stops at `max_new_tokens` or after emitting one of `stop_ids`.
    """
    params = params or SamplerParams(temperature=0.0)
    device = model.device
    pages_per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // page_size)
    kv = allocate_kv(model, pages_per_seq * len(prompts), page_size)
    # sequence i owns pages [i * pages_per_seq, (i + 1) * pages_per_seq)
    page_tables = [
        torch.arange(i * pages_per_seq, (i + 1) * pages_per_seq, device=device) for i in range(len(prompts))
    ]
    generators = [make_generator(params, device) for _ in prompts]
    outputs: list[list[int]] = [[] for _ in prompts]
    lengths = [0] * len(prompts)
    new_tokens = [list(p) for p in prompts]
    active = list(range(len(prompts)))
    stop = set(stop_ids or [])
    while active:
        ids, positions, slots = [], [], []
        for i in active:
            for token in new_tokens[i]:
                position = lengths[i]
                ids.append(token)
                positions.append(position)
                slots.append(int(page_tables[i][position // page_size]) * page_size + position % page_size)
                lengths[i] += 1
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, device=device),
            positions=torch.tensor(positions, device=device),
            out_slots=torch.tensor(slots, device=device),
            seq_lens=[lengths[i] for i in active],
            new_lens=[len(new_tokens[i]) for i in active],
            page_tables=[page_tables[i][: -(-lengths[i] // page_size)] for i in active],
        )
        logits = model(batch, kv, page_size)
        chosen = sample(logits, [params] * len(active), [generators[i] for i in active]).tolist()
        still_active = []
        for i, token in zip(active, chosen):
            outputs[i].append(token)
            new_tokens[i] = [token]
            if len(outputs[i]) < max_new_tokens and token not in stop:
                still_active.append(i)
        active = still_active
    return outputs
