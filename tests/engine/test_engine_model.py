"""Our model against transformers' Llama and Qwen2 on small random configs, through the paged KV pool."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from engine_helpers import hf_and_ours, hf_logits, make_batch, run_in_chunks

from hicache.engine import load_model
from hicache.modelinfo import LlamaConfig

pytest.importorskip("transformers")

PAGE_SIZE = 4
NUM_PAGES = 24


@pytest.mark.parametrize("kind", ["llama", "llama3", "qwen2", "tied"])
def test_matches_transformers_prefill_chunks_and_decode(tmp_path: Path, kind: str) -> None:
    hf, ours = hf_and_ours(tmp_path, kind)
    assert ours.config.attention_bias == (kind == "qwen2")
    assert ours.config.tie_word_embeddings == (kind == "tied")
    tokens = torch.randint(0, 256, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    expected = hf_logits(hf, tokens)
    kv_shape = ours.kv_pool_shape(NUM_PAGES, PAGE_SIZE)

    full = run_in_chunks(ours, torch.zeros(kv_shape), torch.arange(12), tokens, [45], PAGE_SIZE)
    torch.testing.assert_close(full, expected, atol=1e-4, rtol=1e-4)

    # pages scattered through the pool in reverse; chunked prefill then one-token decode steps
    scattered = torch.arange(NUM_PAGES - 1, NUM_PAGES - 13, -1)
    chunks = [7, 1, 13, 16] + [1] * 8
    stepped = run_in_chunks(ours, torch.full(kv_shape, float("nan")), scattered, tokens, chunks, PAGE_SIZE)
    torch.testing.assert_close(stepped, expected, atol=1e-4, rtol=1e-4)


def test_ragged_batches_match_single_sequences(tmp_path: Path) -> None:
    hf, ours = hf_and_ours(tmp_path, "llama3")
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 3, 17)]
    total = [p + torch.randint(0, 256, (6,), generator=gen).tolist() for p in prompts]
    expected = [hf_logits(hf, t) for t in total]
    # shuffled pages, interleaved between the three sequences
    pages = torch.randperm(NUM_PAGES, generator=gen)
    tables = [pages[0:8], pages[8:16], pages[16:24]]
    kv = torch.full(ours.kv_pool_shape(NUM_PAGES, PAGE_SIZE), float("nan"))

    # step 1: sequence 0 prefills fully, sequence 1 only part, sequence 2 fully
    step = [(total[0][:9], 0, tables[0]), (total[1][:2], 0, tables[1]), (total[2][:17], 0, tables[2])]
    logits = ours(make_batch(step, PAGE_SIZE), kv, PAGE_SIZE)
    assert logits.shape == (3, 256) and logits.dtype == torch.float32
    for i, (new, cached, _) in enumerate(step):
        torch.testing.assert_close(logits[i], expected[i][cached + len(new) - 1], atol=1e-4, rtol=1e-4)

    # step 2: mixed; sequence 1 prefills a 2-token chunk while the others decode
    step = [(total[0][9:10], 9, tables[0]), (total[1][2:4], 2, tables[1]), (total[2][17:18], 17, tables[2])]
    logits = ours(make_batch(step, PAGE_SIZE), kv, PAGE_SIZE)
    for i, (new, cached, _) in enumerate(step):
        torch.testing.assert_close(logits[i], expected[i][cached + len(new) - 1], atol=1e-4, rtol=1e-4)

    # then pure batched decode, lengths differing per sequence
    cached = [10, 4, 18]
    while all(c < len(t) for c, t in zip(cached, total)):
        step = [(total[i][cached[i] : cached[i] + 1], cached[i], tables[i]) for i in range(3)]
        logits = ours(make_batch(step, PAGE_SIZE), kv, PAGE_SIZE)
        for i in range(3):
            torch.testing.assert_close(logits[i], expected[i][cached[i]], atol=1e-4, rtol=1e-4)
        cached = [c + 1 for c in cached]


def test_kv_written_where_the_layout_says(tmp_path: Path) -> None:
    _, ours = hf_and_ours(tmp_path, "llama")
    kv = torch.zeros(ours.kv_pool_shape(NUM_PAGES, PAGE_SIZE))
    table = torch.tensor([5, 2])
    ours(make_batch([([1, 2, 3, 4, 5, 6], 0, table)], PAGE_SIZE), kv, PAGE_SIZE)
    written = kv.abs().sum(dim=(0, 1, 4, 5)) != 0  # [pages, page_size]
    expected = torch.zeros(NUM_PAGES, PAGE_SIZE, dtype=torch.bool)
    expected[5, :] = True
    expected[2, :2] = True
    assert torch.equal(written, expected)


def test_random_tiny_and_fingerprint(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        model, tokenizer = load_model("random:tiny", torch.bfloat16, torch.device("cpu"))
    assert "RANDOM weights" in caplog.text
    assert model.dtype == torch.bfloat16
    again, _ = load_model("random:tiny", torch.bfloat16, torch.device("cpu"))
    state, state_again = model.state_dict(), again.state_dict()
    assert state.keys() == state_again.keys()
    assert all(torch.equal(state[key], state_again[key]) for key in state)  # seeded: the same weights
    config = model.config
    assert config.kv_bytes_per_token(torch.bfloat16) == 2 * 2 * 2 * 16 * 2
    assert model.fingerprint_fields() == {
        "model": "random:tiny",
        "revision": "random-seed-0",
        "dtype": "bfloat16",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
    }
    ids = tokenizer.encode("hello")
    kv = torch.zeros(model.kv_pool_shape(4, PAGE_SIZE), dtype=torch.bfloat16)
    logits = model(make_batch([(ids, 0, torch.arange(4))], PAGE_SIZE), kv, PAGE_SIZE)
    assert logits.shape == (1, 512) and torch.isfinite(logits).all()


def test_big_presets_have_the_published_shapes() -> None:
    from hicache.modelinfo import RANDOM_PRESETS

    llama = RANDOM_PRESETS["llama-3.1-8b"]
    assert (llama.num_layers, llama.num_kv_heads, llama.head_dim, llama.vocab_size) == (32, 8, 128, 128256)
    assert llama.rope_scaling["factor"] == 8.0
    assert llama.kv_bytes_per_token(torch.bfloat16) == 131072
    qwen = RANDOM_PRESETS["qwen2.5-7b"]
    assert qwen.attention_bias and qwen.kv_bytes_per_token(torch.bfloat16) == 57344


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(ValueError, match="nope.*smollm2-135m-instruct.*random:tiny"):
        load_model("nope", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="random:huge"):
        load_model("random:huge", torch.float32, torch.device("cpu"))


def test_from_hf_config_reads_transformers_4_keys() -> None:
    config = LlamaConfig.from_hf_config(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 500000.0,
            "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
            "eos_token_id": [1, 2],
        }
    )  # fmt: skip
    assert config.rope_theta == 500000.0 and config.rope_scaling["rope_type"] == "llama3"
    assert config.num_kv_heads == 2 and config.head_dim == 4 and config.eos_token_ids == (1, 2)


def test_precomputed_decode_rows_and_last_rows_give_the_same_logits(tmp_path: Path) -> None:
    """The engine passes the decode rows / lengths and last-token rows in its one upload per step; given, they must
    give exactly what the model derives from the lists itself, and wrong-sized ones are refused."""
    _, ours = hf_and_ours(tmp_path, "llama3")
    gen = torch.Generator().manual_seed(5)
    tokens = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (10, 4, 18)]
    pages = torch.randperm(NUM_PAGES, generator=gen)
    tables = [pages[0:8], pages[8:16], pages[16:24]]
    kv = torch.zeros(ours.kv_pool_shape(NUM_PAGES, PAGE_SIZE))
    ours(make_batch([(tokens[0][:9], 0, tables[0]), (tokens[1][:2], 0, tables[1]), (tokens[2][:17], 0, tables[2])],
                    PAGE_SIZE), kv, PAGE_SIZE)
    # a mixed step: sequences 0 and 2 decode (rows 0 and 3), sequence 1 prefills 2 tokens (rows 1-2)
    step = [(tokens[0][9:10], 9, tables[0]), (tokens[1][2:4], 2, tables[1]), (tokens[2][17:18], 17, tables[2])]
    derived = ours(make_batch(step, PAGE_SIZE), kv.clone(), PAGE_SIZE)
    given = make_batch(step, PAGE_SIZE)
    given.decode_rows, given.decode_lens, given.last_rows = torch.tensor([0, 3]), torch.tensor([10, 18]), \
        torch.tensor([0, 2, 3])
    assert torch.equal(ours(given, kv.clone(), PAGE_SIZE), derived)
    given.decode_rows = torch.tensor([0])
    with pytest.raises(ValueError, match="1 decode rows and 2 lengths given for 2 decode sequences"):
        ours(given, kv.clone(), PAGE_SIZE)
