"""Batched next-token sampling: greedy, temperature, top-k, top-p, with an optional per-request seed."""

from __future__ import annotations

import torch
from torch import Tensor

from hicache.engine.params import SamplerParams


def make_generator(params: SamplerParams, device: torch.device) -> torch.Generator | None:
    """A generator seeded from `params.seed` (None without a seed). Keep one per request across steps."""
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample(
    logits: Tensor, params: list[SamplerParams], generators: list[torch.Generator | None] | None = None
) -> Tensor:
    """Pick one token per row of `logits` [B, vocab]; returns int64 ids [B] on the logits' device.

    Rows with a generator draw from it (reproducible per request, whatever else is in the batch); the
    generators advance as a side effect.
    """
    batch = logits.shape[0]
    if len(params) != batch or (generators is not None and len(generators) != batch):
        raise ValueError(f"got {len(params)} params / generators for {batch} rows of logits")
    generators = generators or [None] * batch
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if not rows:
        return tokens

    index = torch.tensor(rows, device=logits.device)
    temperature = torch.tensor([params[i].temperature for i in rows], device=logits.device)
    probs = torch.softmax(logits[index] / temperature[:, None], dim=-1)
    probs = _filter_top_k_top_p(probs, [params[i].top_k for i in rows], [params[i].top_p for i in rows])

    # exponential race: argmax(p / E) with E ~ Exp(1) draws index i with probability p_i
    noise = torch.empty_like(probs)
    unseeded = [j for j, i in enumerate(rows) if generators[i] is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for j, i in enumerate(rows):
        if generators[i] is not None:
            noise[j].exponential_(generator=generators[i])
    tokens[index] = (probs / noise).argmax(dim=-1)
    return tokens


def _filter_top_k_top_p(probs: Tensor, top_k: list[int], top_p: list[float]) -> Tensor:
    """Zero out tokens outside each row's top-k and top-p nucleus, then renormalise."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return probs
    vocab = probs.shape[1]
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.tensor([vocab if k == -1 else min(k, vocab) for k in top_k], device=probs.device)
    p = torch.tensor(top_p, device=probs.device)
    # keep a sorted token if it is within the top k and the mass before it is below top_p (the first always)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < k[:, None]) & ((mass_before < p[:, None]) | (rank == 0))
    filtered = torch.zeros_like(probs).scatter_(1, order, sorted_probs * keep)
    return filtered / filtered.sum(dim=-1, keepdim=True)
