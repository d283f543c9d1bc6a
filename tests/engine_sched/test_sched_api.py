"""The LLM API and the `hicache generate` command on random:tiny."""

from __future__ import annotations

import hicache
from hicache.cli import main
from hicache.config import Config, override

TINY = {"model.name": "random:tiny", "model.device": "cpu", "cache.page_size": 4,
        "cache.device": {"size_tokens": 512}, "cache.host": {"size_tokens": 256},
        "cache.load_policy.prefill_tokens_per_s": 1000.0}


def test_llm_generate_text_and_ids(tiny):
    llm = hicache.LLM(override(Config(), TINY), model=tiny[0], tokenizer=tiny[1])
    outs = llm.generate(["hello world, hello", [5, 6, 7, 8, 9]], temperature=0.0, max_tokens=6, ignore_eos=True)
    assert [len(o.token_ids) for o in outs] == [6, 6]
    assert outs[0].prompt_token_ids == llm.tokenizer.encode("hello world, hello")
    assert all(o.finish_reason == "length" and o.ttft is not None and o.error is None for o in outs)
    again = llm.generate("hello world, hello", hicache.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert again[0].token_ids == outs[0].token_ids
    assert again[0].cached_tokens["device"] == 16  # 18 prompt tokens: 4 full pages of 4 were cached
    assert llm.stats()["cache"]["hit_tokens"]["device"] == 16
    llm.close()


def test_generate_command(tmp_path, capsys):
    config = tmp_path / "tiny.yaml"
    config.write_text("model: {name: 'random:tiny', device: cpu}\ncache:\n  page_size: 4\n"
                      "  host: {size_tokens: 0}\n  load_policy: {prefill_tokens_per_s: 1000.0}\n")
    rc = main(["generate", "--config", str(config), "--prompt", "hi there", "--max-tokens", "4",
               "--temperature", "0", "--stats"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "prompt tokens" in captured.err


def test_min_tokens_holds_back_stop_ids_and_stop_strings(tiny):
    """The greedy first token made a stop id ends a request at once; with min_tokens 3 it cannot be sampled
    before the third token, and the request runs to at least 3 tokens. min_tokens above max_tokens is refused."""
    import pytest

    llm = hicache.LLM(override(Config(), TINY), model=tiny[0], tokenizer=tiny[1])
    prompt = [5, 6, 7, 8, 9]
    free = llm.generate(prompt, temperature=0.0, max_tokens=6, ignore_eos=True)[0].token_ids
    first = free[0]
    stopped = llm.generate(prompt, temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[first])[0]
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = llm.generate(prompt, temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[first],
                        min_tokens=3)[0]
    assert len(held.token_ids) >= 3 and first not in held.token_ids[:3]
    assert held.finish_reason == ("stop" if first in held.token_ids else "length")
    with pytest.raises(ValueError, match="min_tokens \\(7\\) must not exceed max_tokens \\(6\\)"):
        llm.generate(prompt, max_tokens=6, min_tokens=7)
    llm.close()


def test_generate_help_says_it_samples_by_default(capsys):
    import pytest

    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "default 1.0: it samples" in text and "0 = greedy" in text
