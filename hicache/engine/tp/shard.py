"""Tensor parallelism for the Llama model: one rank's shard of every layer, and the collectives between them.

`shard_model(model, rank, size, group)` cuts a loaded (unfused) `LlamaModel` down, in place, to what rank `rank`
of `size` computes, the usual Megatron way. `load_model(..., shard=TPShard(rank, size, group))` loads each tensor
already cut (`parameter_cut`): a safetensors tensor is read as the rank's slice only, a random one is made whole
and cut at once, so no rank holds more than one whole tensor at a time. The cut:

- attention: the query heads are split evenly; the KV heads too, or, where there are fewer KV heads than ranks,
  each rank keeps the one KV head its query heads read (replicated `size / num_kv_heads` times; logged);
  `o_proj` keeps the matching input columns, and its partial outputs are summed across ranks (one all-reduce);
- MLP: `gate_proj` / `up_proj` keep a slice of the intermediate rows (column-parallel), `down_proj` the matching
  columns (row-parallel), then one all-reduce;
- the LM head keeps a slice of the vocabulary, and the logits are gathered; the token embedding stays whole
  (a lookup, not a matmul: it is a small share of the weights except for small models).

Each rank's KV pool then holds its own heads (`model.kv_pool_shape` follows the shard), so the cache tiers of a
rank store that rank's shard, under a namespace that carries the rank and the size.

Every collective takes the process group's timeout (`torch.distributed.init_process_group(timeout=...)`), so a
rank that dies ends the others' collectives with an error instead of a hang.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

logger = logging.getLogger(__name__)


def check_divisible(config: Any, size: int) -> None:
    """Refuse a tensor-parallel size the model's shapes cannot be split by, naming which."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    problems = []
    if config.num_heads % size:
        problems.append(f"{config.num_heads} attention heads")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        problems.append(f"{config.num_kv_heads} KV heads (neither divides the other)")
    if config.intermediate_size % size:
        problems.append(f"an MLP width of {config.intermediate_size}")
    if config.vocab_size % size:
        problems.append(f"a vocabulary of {config.vocab_size}")
    if problems:
        raise ValueError(f"model {config.name!r} cannot be split over {size} ranks: " + ", ".join(problems))


def kv_heads_of(config: Any, rank: int, size: int) -> tuple[int, int]:
    """The KV heads [first, end) rank `rank` keeps."""
    if config.num_kv_heads >= size:
        per = config.num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank * config.num_kv_heads // size  # the KV head this rank's query heads read
    return head, head + 1


class _AllReduce:
    """Sum a partial output over the group, in place."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __call__(self, x: Tensor) -> Tensor:
        dist.all_reduce(x, group=self.group)
        return x


class _GatherVocab:
    """Concatenate each rank's slice of the logits along the vocabulary."""

    def __init__(self, group: Any, size: int) -> None:
        self.group, self.size = group, size

    def __call__(self, local: Tensor) -> Tensor:
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


def parameter_cut(config: Any, name: str, rank: int, size: int) -> tuple[int, int, int] | None:
    """The part of parameter `name` (a LlamaModel state-dict key) rank `rank` of `size` keeps, as (dim, start, end),
    or None where it keeps the whole tensor (norms, the embedding). `shard_model` makes the same cut; a loader uses
    this to read only the rank's slice of each tensor, so that no rank ever holds the whole model."""
    if size == 1:
        return None
    hd = config.head_dim
    q_per, mlp_per = config.num_heads // size, config.intermediate_size // size
    kv_first, kv_end = kv_heads_of(config, rank, size)
    parts = name.split(".")
    if name == "lm_head.weight":
        per = config.vocab_size // size
        return 0, rank * per, (rank + 1) * per
    if len(parts) < 4 or parts[0] != "layers":
        return None
    module, kind = parts[3], parts[-1]
    if module == "q_proj":
        return 0, rank * q_per * hd, (rank + 1) * q_per * hd
    if module in ("k_proj", "v_proj"):
        return 0, kv_first * hd, kv_end * hd
    if module == "o_proj" and kind == "weight":
        return 1, rank * q_per * hd, (rank + 1) * q_per * hd
    if module in ("gate_proj", "up_proj"):
        return 0, rank * mlp_per, (rank + 1) * mlp_per
    if module == "down_proj" and kind == "weight":
        return 1, rank * mlp_per, (rank + 1) * mlp_per
    return None


def cut_tensor(tensor: Tensor, cut: tuple[int, int, int] | None) -> Tensor:
    """A copy of the kept part of a whole tensor (`parameter_cut`), or the tensor itself."""
    if cut is None:
        return tensor
    dim, start, end = cut
    return tensor.narrow(dim, start, end - start).clone()


class TPShard:
    """A tensor-parallel rank's cut, for `load_model(shard=...)`: the loader reads only each tensor's part
    (`cut`), and calling it on the loaded model sets the rank's head counts and collectives (`shard_model`)."""

    def __init__(self, rank: int, size: int, group: Any = None) -> None:
        self.rank, self.size, self.group = rank, size, group

    def cut(self, config: Any, name: str) -> tuple[int, int, int] | None:
        return parameter_cut(config, name, self.rank, self.size)

    def __call__(self, model: Any) -> Any:
        return shard_model(model, self.rank, self.size, self.group)


def _rows(linear: nn.Linear, start: int, end: int) -> None:
    """Keep output rows [start, end) (a weight loaded already cut to them is kept as it is)."""
    if linear.weight.shape[0] != end - start:
        linear.weight = nn.Parameter(linear.weight.detach()[start:end].clone(), requires_grad=False)
    if linear.bias is not None and linear.bias.shape[0] != end - start:
        linear.bias = nn.Parameter(linear.bias.detach()[start:end].clone(), requires_grad=False)
    linear.out_features = end - start


def _columns(linear: nn.Linear, start: int, end: int) -> None:
    """Keep input columns [start, end) (as `_rows`)."""
    if linear.weight.shape[1] != end - start:
        linear.weight = nn.Parameter(linear.weight.detach()[:, start:end].clone(), requires_grad=False)
    linear.in_features = end - start


def shard_model(model: Any, rank: int, size: int, group: Any = None) -> Any:
    """Cut `model` (a loaded, unfused LlamaModel) to rank `rank`'s shard of `size`, in place; returns it."""
    c = model.config
    check_divisible(c, size)
    if size == 1:
        return model
    if any(layer.self_attn.qkv_proj is not None for layer in model.layers):
        raise ValueError("shard the model before fuse_projections()")
    q_per = c.num_heads // size
    kv_first, kv_end = kv_heads_of(c, rank, size)
    if c.num_kv_heads < size:
        logger.info("tensor parallel %d > %d KV heads: each KV head is kept by %d ranks", size, c.num_kv_heads,
                    size // c.num_kv_heads)
    reduce = _AllReduce(group)
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            for name, linear in (("self_attn.q_proj", attn.q_proj), ("self_attn.k_proj", attn.k_proj),
                                 ("self_attn.v_proj", attn.v_proj), ("self_attn.o_proj", attn.o_proj),
                                 ("mlp.gate_proj", mlp.gate_proj), ("mlp.up_proj", mlp.up_proj),
                                 ("mlp.down_proj", mlp.down_proj)):
                dim, start, end = parameter_cut(c, f"layers.{i}.{name}.weight", rank, size)  # the loaders' cut
                (_rows if dim == 0 else _columns)(linear, start, end)
            attn.num_heads, attn.num_kv_heads = q_per, kv_end - kv_first
            attn.reduce = reduce
            mlp.reduce = reduce
        _, start, end = parameter_cut(c, "lm_head.weight", rank, size)
        head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
        if head.shape[0] == end - start and end - start != c.vocab_size:  # an LM head loaded already cut
            model.head_shard = head.detach()
        else:
            model.head_shard = head.detach()[start:end].clone()
        if model.lm_head is not None:
            model.lm_head = None  # its slice is head_shard; the tied embedding stays whole for the lookup
    model.gather_logits = _GatherVocab(group, size)
    model.config = dataclasses.replace(c, num_heads=q_per, num_kv_heads=kv_end - kv_first,
                                       intermediate_size=c.intermediate_size // size)
    model.tp_rank, model.tp_size = rank, size
    return model
