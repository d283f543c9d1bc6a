"""Sampling: greedy, seeds, top-k / top-p filtering, parameter validation."""

from __future__ import annotations

import pytest
import torch

from hicache.engine.params import SamplerParams
from hicache.engine.sampling import make_generator, sample


def _logits(batch: int = 4, vocab: int = 50) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits()
    assert torch.equal(sample(logits, [SamplerParams(temperature=0.0)] * 4), logits.argmax(-1))
    assert torch.equal(sample(logits, [SamplerParams(top_k=1, temperature=2.0)] * 4), logits.argmax(-1))


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    logits = _logits()
    params = SamplerParams(temperature=1.0, seed=7)

    def draw(rows: list[int]) -> list[list[int]]:
        generators = [make_generator(params, torch.device("cpu")) for _ in rows]
        return [sample(logits[rows], [params] * len(rows), generators).tolist() for _ in range(10)]

    first, second = draw([0, 1, 2, 3]), draw([0, 1, 2, 3])
    assert first == second
    alone = draw([2])
    assert [step[2] for step in first] == [step[0] for step in alone]
    assert len({tuple(step) for step in first}) > 1  # generators advance between steps


def test_top_k_and_top_p_restrict_the_support() -> None:
    logits = _logits(batch=1, vocab=20)
    top3 = set(logits[0].topk(3).indices.tolist())
    params = SamplerParams(temperature=5.0, top_k=3, seed=1)
    generator = make_generator(params, torch.device("cpu"))
    draws = {int(sample(logits, [params], [generator])) for _ in range(200)}
    assert draws <= top3 and len(draws) > 1

    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    nucleus_size = int((probs[order].cumsum(0) < 0.6).sum()) + 1
    params = SamplerParams(temperature=1.0, top_p=0.6, seed=1)
    generator = make_generator(params, torch.device("cpu"))
    draws = {int(sample(logits, [params], [generator])) for _ in range(200)}
    assert draws <= set(order[:nucleus_size].tolist())


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = _logits()
    params = [
        SamplerParams(temperature=0.0),
        SamplerParams(temperature=1.0),
        SamplerParams(temperature=0.0),
    ]
    tokens = sample(logits[:3], params)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_params_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SamplerParams(**kwargs)
