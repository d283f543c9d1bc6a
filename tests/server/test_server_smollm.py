"""The embedded SmolLM2 behind the server: its chat template, a real answer, the system prompt cached."""

from __future__ import annotations

import openai
from server_helpers import tiny_config

from hicache.engine.tokenizer import Tokenizer
from hicache.engine.weights import smollm2_dir


def test_smollm2_chat(tmp_path, start_server) -> None:
    config = tiny_config(tmp_path, **{"model.name": "smollm2-135m-instruct"})
    srv = start_server("--config", str(config), "--no-l3")
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
    system = {"role": "system", "content": "You are a helpful assistant. " * 6}
    messages = [system, {"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=messages, max_tokens=12,
                                       temperature=0)
    tokenizer = Tokenizer.from_dir(smollm2_dir())
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert r.usage.prompt_tokens == len(expected)
    assert "Paris" in r.choices[0].message.content
    again = [system, {"role": "user", "content": "And of Italy?"}]
    r2 = client.chat.completions.create(model="smollm2-135m-instruct", messages=again, max_tokens=4)
    ids2 = tokenizer.encode(tokenizer.apply_chat_template(again, add_generation_prompt=True))
    common = next(i for i, (a, b) in enumerate(zip(expected, ids2)) if a != b)
    assert common >= 32
    assert r2.usage.prompt_tokens_details.cached_tokens == common // 16 * 16  # the shared full pages
