"""Hostile request bodies: every numeric field is type-checked and bounded at the HTTP edge, and no body can stop
the engine. A property test sends arbitrary bodies: each gets 200 or a 4xx OpenAI error object, and /health and
the next valid request are fine afterwards."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODEL = "random:tiny"
COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


def assert_still_serving(server) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    # ignore_eos: the random model samples its end-of-text token now and then, which would end the answer early
    r = post(server, "/v1/completions", {**COMPLETION, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**63), ("top_k", 2**31), ("top_k", -2), ("top_k", "3"), ("top_k", True), ("top_k", 1.0),
    ("max_tokens", "3"), ("max_tokens", True), ("max_tokens", 0), ("max_tokens", -1), ("max_tokens", 2**63),
    ("seed", 2**64), ("seed", -1), ("seed", "7"),
    ("temperature", "1"), ("temperature", True), ("temperature", -0.5), ("temperature", 1e300),
    ("top_p", 0), ("top_p", 1.5), ("top_p", False),
    ("n", 0), ("n", True), ("presence_penalty", 3), ("frequency_penalty", "0"),
    ("stop", ["x"] * 17), ("stop_token_ids", [-1]), ("stop_token_ids", [True]),
])
def test_numeric_fields_are_type_checked_and_bounded(server, field, value) -> None:
    r = post(server, "/v1/completions", {**COMPLETION, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"].split(".")[0] == field, err
    assert field in err["message"]


@pytest.mark.parametrize("field,value,param", [
    ("prompt", [1.0, 2.0], "prompt"), ("prompt", [True, 5], "prompt"), ("prompt", [[7, 2.5]], "prompt"),
    ("stream", "yes", "stream"), ("stream", 1, "stream"), ("ignore_eos", "true", "ignore_eos"),
    ("echo", 0, "echo"), ("logprobs", 0, "logprobs"), ("logprobs", 2, "logprobs"),
])
def test_json_types_are_taken_as_documented(server, field, value, param) -> None:
    """Token ids are JSON integers, flags JSON booleans; logprobs 0 on completions asks for logprobs (refused)."""
    r = post(server, "/v1/completions", {**COMPLETION, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param, r.text


def test_chat_logprobs_false_is_no_request_for_logprobs(server) -> None:
    assert post(server, "/v1/chat/completions", {**CHAT, "logprobs": False}).status_code == 200
    r = post(server, "/v1/chat/completions", {**CHAT, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text


def test_a_single_stop_string_of_any_length_is_accepted(server) -> None:
    """The limit of 16 is on the list of stop strings, not on one string's characters."""
    for stop in ("a stop string longer than sixteen characters", ["another stop string of 33 chars!"] * 16):
        r = post(server, "/v1/completions", {**COMPLETION, "stop": stop})
        assert r.status_code == 200, r.text


def test_max_completion_tokens_is_named_in_its_own_error(server) -> None:
    r = post(server, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens", r.text


@pytest.mark.parametrize("field,value", [("n", 2), ("logit_bias", {"42": 5}), ("presence_penalty", 0.5)])
def test_unsupported_values_are_refused_by_name(server, field, value) -> None:
    r = post(server, "/v1/completions", {**COMPLETION, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"]


def test_the_top_k_that_stopped_the_engine_is_refused_and_the_engine_serves_on(server) -> None:
    r = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "top_k": 9223372036854775808})
    assert r.status_code == 400, r.text
    assert_still_serving(server)
    big = post(server, "/v1/completions", {**COMPLETION, "top_k": 2**31 - 1, "temperature": 1.0, "seed": 3})
    assert big.status_code == 200, big.text  # larger than the vocabulary: all of it


def test_a_vanishing_temperature_samples_greedily(server) -> None:
    greedy = post(server, "/v1/completions", {**COMPLETION, "max_tokens": 6, "temperature": 0})
    tiny = post(server, "/v1/completions", {**COMPLETION, "max_tokens": 6, "temperature": 1e-300})
    assert greedy.status_code == tiny.status_code == 200
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "n", "stop", "stop_token_ids", "seed", "ignore_eos",
          "presence_penalty", "frequency_penalty", "logit_bias", "stream", "stream_options", "logprobs", "echo"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=4), st.booleans())
def test_any_body_gets_200_or_an_error_object(server, fields, chat) -> None:
    base = CHAT if chat else COMPLETION
    body = {**base, **fields}
    if body.get("stream") is True:
        body["stream"] = False  # streamed bodies are covered elsewhere; here the whole answer is one object
    r = post(server, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_the_engine_serves_on_after_hostile_bodies(server) -> None:
    """Hostile bodies of the kinds the fuzzing draws, sent here, so that the check does not depend on test order."""
    for fields in ({"top_k": 2**63}, {"stop": [""] * 3}, {"logit_bias": {"x": "y"}}, {"n": None, "seed": -1},
                   {"stream_options": [1, 2]}, {"max_tokens": 1e308}, {"temperature": "NaN"}):
        for base, path in ((COMPLETION, "/v1/completions"), (CHAT, "/v1/chat/completions")):
            r = post(server, path, {**base, **fields})
            assert 400 <= r.status_code < 500, (fields, r.status_code, r.text)
    assert_still_serving(server)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "x\\ud800y", "max_tokens": 3}', "prompt"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\udfffy"}], "max_tokens": 3}',
     "messages.0.content"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages.0.content"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\ud800"], "max_tokens": 3}', "stop"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(server, path, body, param) -> None:
    r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "Unicode" in r.json()["error"]["message"]


def test_deeply_nested_json_is_a_400(server) -> None:
    deep_array = b"[" * 100_000 + b"]" * 100_000
    r = httpx.post(f"{server.url}/v1/completions", content=deep_array, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text
    part = '{"a": ' * 5000 + "1" + "}" * 5000
    body = ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": ' + part + "}]}]}")
    r = httpx.post(f"{server.url}/v1/chat/completions", content=body.encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert_still_serving(server)


@pytest.mark.parametrize("field,value", [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "required"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}),
    ("response_format", {"type": "json_object"}), ("top_logprobs", 2),
])
def test_openai_features_not_implemented_are_refused_by_name(server, field, value) -> None:
    r = post(server, "/v1/chat/completions", {**CHAT, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
    assert "not supported" in r.json()["error"]["message"]
    ok = post(server, "/v1/chat/completions", {**CHAT, "tool_choice": "none", "response_format": {"type": "text"}})
    assert ok.status_code == 200, ok.text  # the values that ask for nothing are fine


def test_head_health(server) -> None:
    r = httpx.head(f"{server.url}/health", timeout=10)
    assert r.status_code == 200
