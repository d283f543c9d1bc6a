"""Random write/read/delete/reopen sequences against a dict + LRU reference model."""

from __future__ import annotations

import os
import tempfile
from collections import OrderedDict

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from l3_helpers import NAMESPACE, content, empty, key

from tiers.l3 import L3Store

PAGE = 4096 + 1
CAPACITY = 6  # pages
ids = st.lists(st.integers(0, 11), min_size=1, max_size=8)
ops = st.lists(st.one_of(st.tuples(st.just("write"), ids), st.tuples(st.just("read"), ids),
                         st.tuples(st.just("delete"), ids), st.tuples(st.just("reopen"), st.just([]))),
               max_size=25)


def _model_write(model: OrderedDict, batch: list[bytes]) -> list[bool]:
    """What the store promises: present keys refresh; new keys take free slots, then LRU victims
    (never a key of the same batch)."""
    first = list(dict.fromkeys(batch))
    for k in first:
        if k in model:
            model.move_to_end(k)
    new = [k for k in first if k not in model]
    victims = [k for k in model if k not in first][:max(0, len(new) - (CAPACITY - len(model)))]
    for k in victims:
        del model[k]
    written = new[:CAPACITY - len(model)]
    for k in written:
        model[k] = True
    return [k in model for k in batch]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_store_matches_reference_model(sequence):
    with tempfile.TemporaryDirectory() as directory:
        path = os.path.join(directory, "s")

        def reopen() -> L3Store:
            return L3Store(path, CAPACITY * 8192, PAGE, NAMESPACE, io_backend="posix", sync_batch_pages=3)

        store = reopen()
        model: OrderedDict[bytes, bool] = OrderedDict()
        try:
            for op, numbers in sequence:
                batch = [key(n) for n in numbers]
                if op == "write":
                    expected = _model_write(model, batch)
                    assert store.write_pages(batch, [content(k, PAGE) for k in batch]) == expected
                elif op == "read":
                    out = empty(PAGE, len(batch))
                    assert store.read_pages(batch, out) == [k in model for k in batch]
                    for k, page in zip(batch, out):
                        if k in model:
                            model.move_to_end(k)
                            assert torch.equal(page, content(k, PAGE))
                elif op == "delete":
                    assert store.delete(batch) == len(set(batch) & set(model))
                    for k in batch:
                        model.pop(k, None)
                else:
                    store.close()
                    store = reopen()
                assert store.keys() == list(model)
                store.check_integrity()
        finally:
            store.close()
