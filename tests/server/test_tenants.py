"""The tenants file and what it decides: who a key is, which namespace a request is in, each tenant's share."""

from __future__ import annotations

import pytest

from hicache.server.tenants import Tenants, TenantsError
from radix import DEFAULT_NAMESPACE


def build(tmp_path, text: str, api_key: str | None = None) -> Tenants:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    return Tenants.build(api_key, str(path))


def test_keys_name_tenants_and_tenants_name_namespaces(tmp_path):
    tenants = build(tmp_path, "tenants:\n  alice: {keys: [ka1, ka2], share: 0.5}\n  bob: {keys: [kb]}\n"
                              "  ops: {keys: [ko], shared: true}\n", api_key="kd")
    who = {key: tenants.authenticate(f"Bearer {key}").name for key in ("ka1", "ka2", "kb", "ko", "kd")}
    assert who == {"ka1": "alice", "ka2": "alice", "kb": "bob", "ko": "ops", "kd": "default"}
    assert tenants.authenticate("Bearer nope") is None and tenants.authenticate("") is None
    alice, bob, ops, default = (next(t for t in tenants.tenants if t.name == n) for n in ("alice", "bob", "ops",
                                                                                          "default"))
    assert tenants.namespace(ops, None) == tenants.namespace(default, None) == DEFAULT_NAMESPACE
    assert tenants.namespace(ops, "s") == tenants.namespace(default, "s") != DEFAULT_NAMESPACE  # shared salts meet
    ids = {tenants.namespace(alice, None), tenants.namespace(bob, None), tenants.namespace(alice, "s"),
           tenants.namespace(bob, "s"), tenants.namespace(ops, "s"), DEFAULT_NAMESPACE}
    assert len(ids) == 6  # a salt never crosses a tenant's namespace
    assert tenants.namespace(alice, "s").group == alice.group != bob.group
    assert tenants.shares() == {alice.group: 0.5, bob.group: 0.25, 0: 0.25}  # bob and the shared split the rest
    assert tenants.group_names() == {0: "shared", alice.group: "alice", bob.group: "bob"}
    assert "ka1" not in repr(alice) and "ka1" not in repr(tenants.namespace(alice, "ka1"))


def test_without_a_tenants_file_there_is_one_tenant_and_nothing_to_share():
    open_server = Tenants.build(None, None)
    assert not open_server.auth_required and open_server.authenticate("").name == "default"
    assert open_server.shares() == {} and open_server.group_names() == {0: "default"}
    keyed = Tenants.build("k", None)
    assert keyed.auth_required and keyed.authenticate("Bearer k").name == "default"
    assert keyed.namespace(keyed.tenants[0], None) == DEFAULT_NAMESPACE  # an L3 written before tenants matches


@pytest.mark.parametrize("text, message", [
    ("tenants:\n  alice: {keys: [k], sharee: 0.5}\n", "unknown field(s) ['sharee']"),
    ("tenants:\n  'al ice': {keys: [k]}\n", "a name is 1-64 letters"),
    ("tenants:\n  alice: {keys: []}\n", "'keys' must be a non-empty list"),
    ("tenants:\n  alice: {keys: [' k']}\n", "without surrounding spaces"),
    ("tenants:\n  alice: {keys: [k], share: 0.7}\n  bob: {keys: [j], share: 0.6}\n", "add up to 1.3"),
    ("tenants:\n  alice: {keys: [k], share: 0}\n", "'share' must be a number in (0, 1]"),
    ("tenants:\n  alice: {keys: [k], shared: true, share: 0.5}\n", "a shared tenant has no share"),
    ("tenants:\n  alice: {keys: [k]}\n  bob: {keys: [k]}\n", "a key is given to more than one tenant"),
    ("tenants:\n  default: {keys: [k]}\n", "name the tenant otherwise"),
    ("tenant:\n  alice: {keys: [k]}\n", "expected one top-level key 'tenants'"),
    ("tenants: [\n", "not valid YAML"),
    ("tenants:\n  alice: {keys: [k]}\n  alice: {keys: [j]}\n", "'alice' is given twice"),
])
def test_a_bad_tenants_file_is_refused_naming_what_is_wrong(tmp_path, text, message):
    with pytest.raises(TenantsError) as e:
        build(tmp_path, text, api_key="other" if "default" in text else None)
    assert message in str(e.value) and str(tmp_path) in str(e.value)


def test_a_missing_tenants_file_names_the_path(tmp_path):
    with pytest.raises(TenantsError, match="cannot read the tenants file .*nope.yaml"):
        Tenants.build(None, str(tmp_path / "nope.yaml"))


@pytest.mark.parametrize("key", ["", "   "])
def test_an_empty_api_key_is_refused_wherever_it_comes_from(key, monkeypatch):
    import argparse

    from hicache.config import ConfigError, from_dict
    from hicache.server import cli as serve_cli

    with pytest.raises(TenantsError, match="API key is empty"):
        Tenants.build(key, None)
    with pytest.raises(ConfigError, match="server.api_key: is empty"):
        from_dict({"server": {"api_key": key}}, "c.yaml")
    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    with pytest.raises(ConfigError, match="--api-key: the API key is empty"):
        serve_cli.build_config(parser.parse_args(["serve", "--api-key", key]))
    monkeypatch.setenv(serve_cli.API_KEY_ENV, key)
    with pytest.raises(ConfigError, match=r"\$HICACHE_API_KEY: the API key is empty"):
        serve_cli.build_config(parser.parse_args(["serve"]))


def test_an_empty_bearer_token_never_authenticates():
    tenants = Tenants.build("sk-key", None)
    assert tenants.authenticate("Bearer sk-key") is not None
    for header in ("Bearer ", "Bearer", "bearer   ", ""):
        assert tenants.authenticate(header) is None
