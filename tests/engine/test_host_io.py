"""HostStaging: step inputs up and sampled tokens down through a mapped pinned buffer (CUDA only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.engine.host_io import HostStaging

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("mapped", [True, False])
def test_round_trip_and_growth(mapped):
    staging = HostStaging(torch.device("cuda"), size=8)
    if not mapped:
        staging.alias, staging.mapped = None, False
    values = np.arange(100, dtype=np.int64) * 7 - 3  # more than the buffer: it grows
    up = staging.upload(values)
    assert up.device.type == "cuda" and up.tolist() == values.tolist()
    second = staging.upload([5, 6, 7])  # reuses the buffer; the first upload's tensor is unaffected
    assert second.tolist() == [5, 6, 7] and up[:3].tolist() == [-3, 4, 11]
    down = staging.download(torch.arange(300, device="cuda") * 3)
    assert down == [3 * i for i in range(300)]


def test_download_sees_queued_work():
    staging = HostStaging(torch.device("cuda"))
    x = torch.zeros(1 << 20, device="cuda")
    for _ in range(50):  # keep the stream busy so the read has to wait for the argmax below
        x = x * 1.0001 + 1
    token = torch.argmax(torch.cat([x[:1] * 0, torch.tensor([1.0], device="cuda")])).reshape(1)
    assert staging.download(token) == [1]


def test_an_upload_does_not_overwrite_inputs_a_queued_kernel_has_yet_to_read():
    staging = HostStaging(torch.device("cuda"))
    x = torch.zeros(1 << 22, device="cuda")
    firsts = []
    for i in range(20):
        for _ in range(20):  # queue work so the upload's kernel runs well after the host moved on
            x = x * 1.0001 + 1
        firsts.append(staging.upload(np.full(1000, i, dtype=np.int64)))
    assert [int(t[0]) for t in firsts] == list(range(20)) and all(int(t[-1]) == i for i, t in enumerate(firsts))
