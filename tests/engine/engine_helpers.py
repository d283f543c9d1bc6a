"""Shared helpers for engine tests: run token chunks through a model over a scattered paged KV pool."""

from __future__ import annotations

import torch
from torch import Tensor

from hicache.engine.model import ForwardBatch, LlamaModel


def slot(page_table: Tensor, position: int, page_size: int) -> int:
    """Flat KV slot of `position` in a sequence with `page_table`."""
    return int(page_table[position // page_size]) * page_size + position % page_size


def make_batch(
    sequences: list[tuple[list[int], int, Tensor]], page_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """ForwardBatch from (new tokens, number already cached, page table) per sequence."""
    ids, positions, slots, seq_lens, new_lens, tables = [], [], [], [], [], []
    for new_tokens, cached, page_table in sequences:
        seq_len = cached + len(new_tokens)
        ids += new_tokens
        positions += list(range(cached, seq_len))
        slots += [slot(page_table, p, page_size) for p in range(cached, seq_len)]
        seq_lens.append(seq_len)
        new_lens.append(len(new_tokens))
        tables.append(page_table[: -(-seq_len // page_size)])
    return ForwardBatch(
        input_ids=torch.tensor(ids, device=device),
        positions=torch.tensor(positions, device=device),
        out_slots=torch.tensor(slots, device=device),
        seq_lens=seq_lens,
        new_lens=new_lens,
        page_tables=tables,
    )


def run_in_chunks(
    model: LlamaModel, kv: Tensor, page_table: Tensor, tokens: list[int], chunks: list[int], page_size: int
) -> Tensor:
    """Feed `tokens` as consecutive chunks of the given sizes; return all new-token logits [len, vocab]."""
    if sum(chunks) != len(tokens):
        raise ValueError("chunks must cover the tokens")
    logits, cached = [], 0
    for size in chunks:
        batch = make_batch([(tokens[cached : cached + size], cached, page_table)], page_size)
        logits.append(model(batch, kv, page_size, all_logits=True))
        cached += size
    return torch.cat(logits)
