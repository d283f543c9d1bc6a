"""The Triton prefix-attention kernel against plain causal attention (CPU, through Triton's interpreter)."""

from __future__ import annotations

import math

import pytest
import torch


def causal_attention(q: torch.Tensor, kv: torch.Tensor, table: torch.Tensor, seq_len: int, page_size: int):
    """The last q.shape[0] positions of a seq_len-token sequence attending to keys up to their own, directly."""
    new, heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    slots = (table[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:seq_len]
    k = kv[0].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
    v = kv[1].reshape(-1, kv_heads, head_dim)[slots].repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    positions = torch.arange(seq_len - new, seq_len)
    hidden = torch.arange(seq_len)[None, :] > positions[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(hidden, float("-inf")).softmax(-1), v)


def test_kernel_matches_causal_attention_over_the_page_table(interpreted_prefill: dict) -> None:
    case = interpreted_prefill["kernel"]
    assert len(case["cases"]) == 8
    for c in case["cases"]:
        expected = causal_attention(c["q"], case["kv"], case["table"], c["seq_len"], case["page_size"])
        assert len(c["got"]) == 10  # every launch shape of prefill_kernel_check.CONFIGS, and its SPLIT_CASES
        for name, got in c["got"].items():
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"seq_len {c['seq_len']}, {name}")


def test_model_prefill_through_kernel_matches_sdpa(interpreted_prefill: dict) -> None:
    case = interpreted_prefill["model"]
    assert case["supported"] is True and case["ran"] is True  # the kernel ran: no fallback to SDPA
    assert case["splits_warmed"] == 5  # the warm-up ran the split kernel and each padded merge
    torch.testing.assert_close(case["kernel"], case["sdpa"], atol=1e-4, rtol=1e-4)
    # the chunk's K/V went to the same slots (layer 2's depend on layer 1's attention: equal up to rounding)
    torch.testing.assert_close(case["kernel_kv"], case["sdpa_kv"], atol=1e-5, rtol=1e-5)
    assert torch.count_nonzero(case["kernel_kv"]) == torch.count_nonzero(case["sdpa_kv"])


def test_mixed_step_through_both_kernels_matches_the_reference(interpreted_mixed: dict) -> None:
    """Decodes, chunks over prefixes and a whole prompt in one step: the kernels (writing their rows of the output in
    place when the decodes come first) give the reference path's logits and pool."""
    case = interpreted_mixed
    assert case["ran"] is True
    results = case["results"]
    for order in ("decodes first", "decodes last"):
        (ref_logits, ref_pool), (logits, pool) = results[order, False], results[order, True]
        assert logits.shape == (5, ref_logits.shape[1])
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=order)
        torch.testing.assert_close(pool, ref_pool, atol=1e-5, rtol=1e-5, msg=order)
    # the same sequences in another order: the same logits per sequence
    first, last = results["decodes first", True][0], results["decodes last", True][0]
    torch.testing.assert_close(last, first[[2, 4, 3, 0, 1]], atol=1e-4, rtol=1e-4)


def test_refuses_a_page_table_too_short_for_the_sequence() -> None:
    pytest.importorskip("triton")
    from hicache.engine.kernels.prefill import paged_prefix_attention

    pool = torch.zeros(4, 16, 2, 16)
    with pytest.raises(ValueError, match="8 new tokens of a 40-token sequence with 2 pages of 16"):
        paged_prefix_attention(torch.zeros(8, 4, 16), pool, pool, torch.tensor([0, 1]), 40)


def test_a_kernel_that_does_not_fit_the_gpu_falls_back_to_sdpa_for_good(monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that fails for resources (a GPU with less shared memory) is logged once; that chunk and every later
    one attend through gather + SDPA with the same result, and the model stops planning the kernel."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from hicache.engine import attention, load_model
    from hicache.engine import model as model_module
    from hicache.engine.kernels import prefill as prefill_kernel

    monkeypatch.setattr(prefill_kernel, "_unavailable", {})
    launches = []

    class DoesNotFit:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launches.append(grid)
                raise OutOfResources(262144, 232448, "shared memory")

            return launch

    monkeypatch.setattr(prefill_kernel, "_prefix_attention_kernel", DoesNotFit())
    monkeypatch.setattr(model_module, "kernel_supported", lambda *args: True)
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    model.prefill_kernel = True
    assert model.uses_prefill_kernel(16)
    gen = torch.Generator().manual_seed(1)
    pool = torch.randn(2, 4, 16, 2, 16, generator=gen)  # [k/v, pages, page_size, kv_heads, head_dim]
    table = torch.tensor([2, 0, 3])
    q = torch.randn(8, 4, 16, generator=gen)  # the last 8 of a 40-token sequence
    k_flat, v_flat = pool[0].view(-1, 2, 16), pool[1].view(-1, 2, 16)
    slots = attention.slots_of(table, 40, 16)
    k, v = k_flat[slots[32:]], v_flat[slots[32:]]
    planned = attention.PrefillSeq(0, 8, 40, page_table=table)
    got = attention._attend_prefill(q, k, v, pool, k_flat, v_flat, planned)
    visible = torch.arange(40)[None, :] <= torch.arange(32, 40)[:, None]
    gathered = attention.PrefillSeq(0, 8, 40, slots, visible)
    torch.testing.assert_close(got, attention._attend_prefill(q, k, v, pool, k_flat, v_flat, gathered))
    torch.testing.assert_close(got, causal_attention(q, pool, table, 40, 16), atol=1e-5, rtol=1e-5)
    assert len(launches) == 1 and not prefill_kernel.prefix_kernel_available(torch.device("cpu"))
    attention._attend_prefill(q, k, v, pool, k_flat, v_flat, planned)  # no second try
    assert len(launches) == 1 and not model.uses_prefill_kernel(16)
    with pytest.raises(prefill_kernel.PrefixKernelUnavailable, match="OutOfResources"):
        prefill_kernel.paged_prefix_attention(q, pool[0], pool[1], table, 40)


def test_default_shapes_put_tma_first_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """TMA first on a Hopper GPU with contiguous pools of 64-token pages; otherwise, or once it failed, the plain
    shape alone; the interpreter's shape on CPU."""
    pytest.importorskip("triton")
    from hicache.engine.kernels import prefill as pk

    monkeypatch.setattr(pk, "_unavailable", {})
    cuda = torch.device("cuda")  # only a name here: _tma_supported is the one that asks the GPU
    pool = torch.zeros(2, 4, 64, 2, 16)
    monkeypatch.setattr(pk, "_tma_supported", lambda device: True)
    assert pk.default_configs(cuda, pool[0], pool[1]) == [pk.TMA_CONFIG, pk.CUDA_CONFIG]
    small_pages = torch.zeros(2, 4, 16, 2, 16)
    assert pk.default_configs(cuda, small_pages[0], small_pages[1]) == [pk.CUDA_CONFIG]
    strided = torch.zeros(4, 64, 2, 2, 16)[:, :, 0]  # K of a [pages, page, k/v, heads, dim] layout: not contiguous
    assert pk.default_configs(cuda, strided, strided) == [pk.CUDA_CONFIG]
    assert pk.default_configs(torch.device("cpu"), pool[0], pool[1]) == [pk.INTERPRETER_CONFIG]
    pk._unavailable[pk.TMA_CONFIG] = "OutOfResources: shared memory"
    assert pk.default_configs(cuda, pool[0], pool[1]) == [pk.CUDA_CONFIG] and pk.prefix_kernel_available(cuda)
    monkeypatch.setattr(pk, "_tma_supported", lambda device: False)
    monkeypatch.setattr(pk, "_unavailable", {})
    assert pk.default_configs(cuda, pool[0], pool[1]) == [pk.CUDA_CONFIG]


def test_a_shape_that_fails_falls_through_to_the_next_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first default shape does not fit: the call goes on with the second, and later calls skip the first;
    when the last fails too, PrefixKernelUnavailable names why."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from hicache.engine.kernels import prefill as pk

    monkeypatch.setattr(pk, "_unavailable", {})
    first, second = pk.PrefixKernelConfig(128, 16), pk.PrefixKernelConfig(16, 16)
    monkeypatch.setattr(pk, "default_configs",
                        lambda device, k=None, v=None: [c for c in (first, second) if c not in pk._unavailable])
    launches, fits = [], {16}

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, BLOCK_M, **kwargs):
                launches.append(BLOCK_M)
                if BLOCK_M not in fits:
                    raise OutOfResources(262144, 232448, "shared memory")
                args[6].fill_(float(BLOCK_M))  # the output: which shape wrote it

            return launch

    monkeypatch.setattr(pk, "_prefix_attention_kernel", Kernel())
    pool = torch.zeros(2, 4, 16, 2, 16)
    q, table = torch.zeros(8, 4, 16), torch.tensor([2, 0, 3])
    assert float(pk.paged_prefix_attention(q, pool[0], pool[1], table, 40)[0, 0, 0]) == 16.0
    assert launches == [128, 16] and first in pk._unavailable and second not in pk._unavailable
    pk.paged_prefix_attention(q, pool[0], pool[1], table, 40)
    assert launches == [128, 16, 16]  # the failed shape is not tried again
    fits.clear()
    with pytest.raises(pk.PrefixKernelUnavailable, match="OutOfResources"):
        pk.paged_prefix_attention(q, pool[0], pool[1], table, 40)
    assert launches == [128, 16, 16, 16] and not pk.prefix_kernel_available(torch.device("cpu"))


def test_warm_up_runs_one_chunk_over_a_prefix_through_the_kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """build_engine's warm-up (CUDA) sends one page over a one-page prefix through the model: every layer asks the
    prefix kernel for it, so the kernel compiles (or is found not to fit) before the server takes requests."""
    from hicache.engine import attention, load_model
    from hicache.engine import model as model_module
    from hicache.engine.assembly import warm_up_prefix_kernel
    from hicache.engine.kernels.prefill import PrefixKernelUnavailable

    calls = []

    def kernel(q, k_pool, v_pool, page_table, seq_len, out=None):
        calls.append((q.shape[0], seq_len, page_table.tolist()))
        raise PrefixKernelUnavailable("recorded")  # the layer then attends through SDPA

    monkeypatch.setattr(attention, "paged_prefix_attention", kernel)
    monkeypatch.setattr(model_module, "kernel_supported", lambda *args: True)
    model, _ = load_model("random:tiny", torch.float32, torch.device("cpu"))
    model.prefill_kernel = True
    assert warm_up_prefix_kernel(model, 16) > 0
    assert calls == [(16, 32, [0, 1])] * model.config.num_layers


def test_plan_marks_decodes_planned_first_and_steps_without_sdpa() -> None:
    """plan_attention's flags: decode rows 0..D-1 are read and written in place; a step whose attention all runs
    through the kernels skips the SDPA backend context."""
    from hicache.engine.attention import plan_attention

    def tables_for(seq_lens):
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + -(-n // 16))
        return [torch.arange(a, b) for a, b in zip(starts, starts[1:])]

    def plan(seq_lens, new_lens, prefill_kernel=True):
        positions = torch.cat([torch.arange(n - k, n) for n, k in zip(seq_lens, new_lens)])
        return plan_attention(positions, seq_lens, new_lens, tables_for(seq_lens), 16, decode_kernel=True,
                              prefill_kernel=prefill_kernel)

    first = plan([20, 9, 30], [1, 1, 12])  # two decodes, then a chunk over a prefix
    assert first.decode_first and not first.sdpa and first.decode_rows.tolist() == [0, 1]
    last = plan([30, 20, 9], [12, 1, 1])  # the chunk first: its rows precede the decodes
    assert not last.decode_first and not last.sdpa and last.decode_rows.tolist() == [12, 13]
    whole = plan([20, 9, 12], [1, 1, 12])  # a prompt with nothing cached goes through SDPA
    assert whole.decode_first and whole.sdpa
    assert plan([20, 9, 30], [1, 1, 12], prefill_kernel=False).sdpa  # chunks gathered for SDPA
    chunks_only = plan([30, 16, 25], [12, 4, 5])
    assert not chunks_only.sdpa and chunks_only.kernel is None
    reference = plan_attention(torch.tensor([19, 8]), [20, 9], [1, 1], tables_for([20, 9]), 16)  # no decode kernel
    assert reference.sdpa and not reference.decode_first


def test_keys_are_split_only_where_few_programs_walk_a_long_prefix() -> None:
    pytest.importorskip("triton")
    from hicache.engine.kernels import prefill

    cpu = torch.device("cpu")  # 8 "multiprocessors" off CUDA: a target of 32 programs
    # 64 new tokens over a 45k prefix, a program per query head: 32 programs fill the target
    assert prefill.prefix_splits_for(64, 45_120, 32, 64, cpu) == 1
    # 4 programs: 8 splits make the 32
    assert prefill.prefix_splits_for(64, 45_120, 4, 64, cpu) == 8
    # a short prefix: each split keeps at least SPLIT_MIN_STEPS steps of keys
    assert prefill.prefix_splits_for(64, 64 + 3 * 16 * 64, 1, 64, cpu) == 3
    assert prefill.prefix_splits_for(64, 64 + 15 * 64, 1, 64, cpu) == 1
    # the partial outputs stay within SPLIT_MAX_ROWS rows of new tokens x splits
    assert prefill.prefix_splits_for(2048, 2048 + 45_056, 1, 64, cpu) == prefill.SPLIT_MAX_ROWS // 2048
