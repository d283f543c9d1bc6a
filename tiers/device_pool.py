"""The GPU KV pool (L1): one layer-first tensor [layers][k|v][pages][page_size][kv_heads][head_dim]."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tiers.base import AllocatorBacked, KVLayout, PageAllocator


class DevicePool(AllocatorBacked):
    """Paged KV storage on any torch device, laid out layer-first so attention reads one layer at once."""

    def __init__(self, layout: KVLayout, num_pages: int, dtype: torch.dtype, device: torch.device | str):
        if num_pages <= 0:
            raise ValueError(f"device pool needs at least one page, got {num_pages}")
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)
        self.page_bytes = layout.page_bytes
        self.capacity_pages = num_pages
        self.kv = torch.zeros(
            (layout.num_layers, 2, num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim),
            dtype=dtype,
            device=self.device,
        )
        self.allocator = PageAllocator(num_pages, "device")

    def index(self, pages: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(pages), dtype=torch.long, device=self.device)

    def read_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """Copy of `pages` in page-first order: [n][layers][k|v][page_size][kv_heads][head_dim]."""
        return self.kv.index_select(2, self.index(pages)).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write_pages(self, pages: Sequence[int], data: torch.Tensor) -> None:
        """Write page-first `data` ([n][layers][k|v][...]) into `pages`."""
        src = data.to(self.device, self.dtype).permute(1, 2, 0, 3, 4, 5)
        self.kv.index_copy_(2, self.index(pages), src)

    def stats(self) -> dict[str, Any]:
        return {
            "capacity_pages": self.capacity_pages,
            "used_pages": self.used_pages(),
            "page_bytes": self.page_bytes,
            "device": str(self.device),
        }
