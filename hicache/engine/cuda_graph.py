"""CUDA graphs of the decode step: one graph per batch size, replayed over static input buffers.

A decode step of an 8B model is ~450 kernel launches; launched one by one from Python it takes 20-30 ms
of host time on the H200 against ~5 ms of GPU work, so decode is launch-bound. `LlamaModel.decode_forward`
reads only device tensors (token ids, positions, KV slots, sequence lengths, page tables) and syncs with
nothing, so it is captured once per batch size at startup and each step becomes one host-to-device
copy of the inputs plus one graph launch.

Inputs live in one flat int64 device buffer (ids, positions, slots and lengths of max_batch rows, then a
[max_batch, max_pages] page table); a step fills a pinned host copy of it and sends the rows it uses (a
kernel reads them through the mapped pinned buffer where CuPy can map it, see hicache.engine.host_io).
The graphs share one memory pool, captured largest first so smaller batches reuse its blocks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hicache.engine.attention import DecodePlan
from hicache.engine.host_io import kernel_copy
from tiers import map_host_tensor

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """Captured decode steps for batch sizes 1..max_batch of `model` over the pool `kv`.

    Build, `capture()` while the pool holds no data (capture runs each step once eagerly on zeroed inputs,
    which writes K/V into slot 0), then `run(...)` a decode step of any captured size. Engine thread only.
    """

    def __init__(self, model: Any, kv: Tensor, page_size: int, max_batch: int, max_pages: int):
        if kv.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV pool, got {kv.device}")
        if not model.uses_decode_kernel(page_size):
            raise ValueError("CUDA graphs need the paged decode kernel (Triton, power-of-two page size and head_dim)")
        if max_batch < 1 or max_pages < 1:
            raise ValueError(f"max_batch ({max_batch}) and max_pages ({max_pages}) must be positive")
        self.model = model
        self.kv = kv
        self.page_size = page_size
        self.max_batch = max_batch
        self.max_pages = max_pages
        size = 4 * max_batch + max_batch * max_pages
        self._inputs = torch.zeros(size, dtype=torch.int64, device=kv.device)
        self._staging = torch.zeros(size, dtype=torch.int64, pin_memory=True)
        self._host = self._staging.numpy()  # numpy view: cheap element writes from Python
        self._host_table = self._host[4 * max_batch :].reshape(max_batch, max_pages)
        self._alias = map_host_tensor(self._staging, kv.device)  # read by a kernel: see hicache.engine.host_io
        self._sent = torch.cuda.Event()  # the last H2D copy out of `_staging`
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor]] = {}
        self.capture_s = 0.0
        self.replays = 0

    # ------------------------------------------------------------------ capture

    def _column(self, index: int, batch: int) -> Tensor:
        start = index * self.max_batch
        return self._inputs[start : start + batch]

    def _step(self, batch: int) -> Tensor:
        table = self._inputs[4 * self.max_batch :].view(self.max_batch, self.max_pages)[:batch]
        plan = DecodePlan(page_table=table, seq_lens=self._column(3, batch))
        return self.model.decode_forward(
            self._column(0, batch), self._column(1, batch), self._column(2, batch), plan, self.kv
        )

    def capture(self, sizes: Sequence[int] | None = None) -> DecodeGraphs:
        """Capture the decode step for `sizes` (default 1..max_batch); returns self."""
        sizes = sorted(set(sizes or range(1, self.max_batch + 1)), reverse=True)
        if sizes[0] > self.max_batch or sizes[-1] < 1:
            raise ValueError(f"batch sizes must be in [1, {self.max_batch}], got {sizes}")
        start = time.perf_counter()
        self._inputs.zero_()  # sequence lengths 0: attention reads nothing; K/V of the warm-up go to slot 0
        torch.cuda.synchronize(self.kv.device)
        side = torch.cuda.Stream(self.kv.device)  # warm up (Triton compiles, cuBLAS picks kernels) off the default
        side.wait_stream(torch.cuda.current_stream(self.kv.device))
        with torch.cuda.stream(side):
            for batch in sizes:
                self._step(batch)
        torch.cuda.current_stream(self.kv.device).wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        for batch in sizes:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._step(batch)
            self._graphs[batch] = (graph, logits)
        torch.cuda.synchronize(self.kv.device)
        self.capture_s = time.perf_counter() - start
        logger.info("captured %d decode CUDA graphs (batch %d-%d) in %.1f s", len(sizes), sizes[-1], sizes[0],
                    self.capture_s)
        return self

    # ------------------------------------------------------------------ run

    def can_run(self, batch: int, longest_pages: int) -> bool:
        return batch in self._graphs and longest_pages <= self.max_pages

    def run(
        self, token_ids: Sequence[int], positions: Sequence[int], page_tables: Sequence[Sequence[int]]
    ) -> Tensor:
        """Logits [B, vocab] (float32, a static buffer valid until the next run) of one decode step.

        Sequence i feeds token_ids[i] at positions[i]; page_tables[i] holds at least positions[i] //
        page_size + 1 pages, the last receiving this token's K/V.
        """
        batch = len(token_ids)
        graph, logits = self._graphs[batch]
        ps, mb, host = self.page_size, self.max_batch, self._host
        self._sent.synchronize()  # the previous step's copy has left the staging buffer
        for row, (token, pos, pages) in enumerate(zip(token_ids, positions, page_tables)):
            num_pages = pos // ps + 1
            host[row] = token
            host[mb + row] = pos
            host[2 * mb + row] = pages[num_pages - 1] * ps + pos % ps
            host[3 * mb + row] = pos + 1
            self._host_table[row, :num_pages] = pages[:num_pages]
        table_end = 4 * mb + batch * self.max_pages
        for lo, hi in ((0, 4 * mb), (4 * mb, table_end)):
            if self._alias is not None:  # a kernel reads the mapped staging: no copy-engine queue to wait in
                kernel_copy(self._inputs[lo:hi], self._alias[lo:hi])
            else:
                self._inputs[lo:hi].copy_(self._staging[lo:hi], non_blocking=True)
        self._sent.record()
        graph.replay()
        self.replays += 1
        return logits


def decode_graph_pages(max_context: int, page_size: int, pool_pages: int) -> int:
    """Page-table width for the graphs: a sequence can span neither more than the context nor the pool."""
    return max(1, min(-(-max_context // page_size), pool_pages))

