"""SGLang's own HiCache storage classes on a CPU: its backend factory, its file backend and a real
`MHATokenToKVPoolHost`.

The host pool's module imports every model config of SGLang, and one of those (a vision model's) imports
torchvision at module level. PyPI's torchvision wheels are CUDA builds that do not load beside a CPU torch, and no
code of the host pool uses torchvision, so `host_pool_module` imports it with torchvision served as an inert
package (any attribute a placeholder that raises if called), then takes that package away again."""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is not installed in this test environment")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)


class _InertModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _InertTorchvision:
    """A meta-path finder that serves `torchvision` and its submodules as inert modules."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name.split(".")[0] == "torchvision":
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        module = _InertModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def host_pool_module() -> Any:
    """`sglang.srt.mem_cache.pool_host.mha`, imported with torchvision inert (see the module doc)."""
    name = "sglang.srt.mem_cache.pool_host.mha"
    if name in sys.modules:
        return sys.modules[name]
    finder = _InertTorchvision()
    sys.meta_path.insert(0, finder)
    try:
        return importlib.import_module(name)
    finally:
        sys.meta_path.remove(finder)
        for module in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[module]


LAYERS, HEADS, HEAD_DIM, PAGE = 2, 2, 8, 4
DEVICE_TOKENS = 64


def host_pool(layout: str, dtype: torch.dtype = torch.bfloat16) -> Any:
    """A real MHATokenToKVPoolHost on the CPU (unpinned: pinning asks CUDA), twice the device pool's tokens."""
    mha = host_pool_module()
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

    k = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    v = tuple(torch.zeros(DEVICE_TOKENS, HEADS, HEAD_DIM, dtype=dtype) for _ in range(LAYERS))
    pointers = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=pointers(k), v_data_ptrs=pointers(v),
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=HEADS, head_dim=HEAD_DIM, v_head_dim=HEAD_DIM, dtype=dtype,
                         device=torch.device("cpu"))
    return mha.MHATokenToKVPoolHost(info, host_to_device_ratio=2.0, host_size=0, page_size=PAGE, layout=layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=DEVICE_TOKENS,
                                    start_layer=0, end_layer=LAYERS)


def storage_config(extra: dict[str, Any], model: str = "org/model", tp: tuple[int, int] = (0, 1),
                   mla: bool = False, layout: str = "page_first") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=layout == "page_first", model_name=model, extra_config=extra)


def page_keys(n: int, start: int = 0) -> list[str]:
    """SGLang-style page keys: 64 hex digits each."""
    return [f"{i:064x}" for i in range(start, start + n)]


def fill(pool: Any, seed: int) -> None:
    """Random KV in every slot of the pool."""
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
