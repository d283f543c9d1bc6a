"""Typed config: loading, validation errors that name key and file, overrides, CLI exit codes."""

import pytest

from hicache.cli import main
from hicache.config import Config, ConfigError, from_dict, load_config, override, set_tier_tokens
from hicache.sizes import resolve_sizes


def test_defaults_and_shipped_configs_are_valid():
    assert load_config(None) == Config()
    for name in ("configs/default.yaml", "configs/h200-llama8b.yaml"):
        cfg = load_config(name)
        assert cfg.cache.page_size in (16, 64)
    cfg = load_config("configs/h200-llama8b.yaml")
    sizes = resolve_sizes(cfg, 131072)  # Llama-3.1-8B bf16: 128 KiB per token
    assert sizes.page_bytes == 8 << 20 and sizes.device_pages == 1024 and sizes.host_pages == 6144
    assert Config().cache.load_policy.overlap
    assert not from_dict({"cache": {"load_policy": {"overlap": False}}}).cache.load_policy.overlap


def test_the_config_write_policy_is_the_controllers():
    from controller import WritePolicy

    assert from_dict({}).cache.write_policy == WritePolicy() and WritePolicy().l3_admit == "reuse"
    cfg = from_dict({"cache": {"write_policy": {"l3_admit": "all", "l3_host_share": 0.25},
                               "load_policy": {"prefetch_host_share": 0.75}}})
    wp = cfg.cache.write_policy
    assert isinstance(wp, WritePolicy) and wp.l3_admit == "all" and wp.l3_host_share == 0.25
    assert cfg.cache.load_policy.prefetch_host_share == 0.75


def test_a_capped_l3_prices_its_reads_at_the_cap():
    """cache.l3.read_limit_gbps below the disk's measured (here: configured) speed: the cost model, and so prefetch's
    queue and the plan's split, take the cap from the start; without an L3 path the cap means nothing."""
    from controller import CostModel
    from hicache.cache import calibrate_bandwidths

    def priced(l3: dict) -> float | None:
        cfg = from_dict({"cache": {"l3": l3, "load_policy": {"host_to_device_gbps": 50, "disk_to_device_gbps": 20}}})
        lp = cfg.cache.load_policy
        cost = CostModel(64, 1 << 20, "auto", 1e4, lp.host_to_device_gbps * 1e9, lp.disk_to_device_gbps * 1e9)
        return calibrate_bandwidths(cost, cfg, None, object(), None, object()).disk_to_device_bytes_per_s

    assert priced({"path": "/l3", "read_limit_gbps": 4}) == 4e9
    assert priced({"path": "/l3", "read_limit_gbps": 40}) == 20e9
    assert priced({"path": "/l3"}) == 20e9
    assert priced({"path": None, "read_limit_gbps": 4}) == 20e9


@pytest.mark.parametrize(
    "data, message",
    [
        ({"cache": {"page_sise": 16}}, "unknown key 'cache.page_sise'"),
        ({"cache": {"page_size": "16"}}, "cache.page_size: expected an integer"),
        ({"cache": {"page_size": 12}}, "cache.page_size: must be a positive power of two"),
        ({"cache": {"host": {"size_gib": -1}}}, "cache.host.size_gib: must be >= 0"),
        ({"cache": {"host": {"size_gib": 1, "size_tokens": 5}}}, "give exactly one of"),
        ({"cache": {"write_policy": {"device_to_host": "sometimes"}}}, "is not one of"),
        ({"cache": {"write_policy": {"defer_above_free": 1.5}}}, r"write_policy.defer_above_free: must be in \[0, 1\]"),
        ({"server": {"port": 70000}}, "server.port: must be in 1..65535"),
        ({"model": {"dtype": "int3"}}, "model.dtype"),
        ({"cache": {"l3": {"path": ""}}}, "cache.l3.path: must not be empty"),
        ({"scheduler": {"chunk_tokens": True}}, "expected an integer"),
        ({"scheduler": {"prefill_batch_tokens": -1}}, "scheduler.prefill_batch_tokens: must be >= 0"),
        ({"cache": {"load_policy": {"overlap": "yes"}}}, "cache.load_policy.overlap"),
        ({"cache": {"remote": {"url": "memcached://m:1"}}}, "the scheme must be redis:// or valkey://"),
        ({"cache": {"remote": {"url": "mooncake://m:50051"}}}, "needs metadata"),
        ({"cache": {"write_policy": {"l3_admit": "sometimes"}}}, "cache.write_policy.l3_admit"),
        ({"cache": {"write_policy": {"l3_only_if_loads_pay": False}}},
         "unknown key 'cache.write_policy.l3_only_if_loads_pay'"),
        ({"cache": {"write_policy": {"l3_host_share": 0}}}, "cache.write_policy.l3_host_share: must be in"),
        ({"cache": {"load_policy": {"prefetch_host_share": 1.5}}}, "cache.load_policy.prefetch_host_share: must be in"),
        ({"cache": {"load_policy": {"prefetch_queue_s": -0.1}}}, "cache.load_policy.prefetch_queue_s: must be >= 0"),
        ({"cache": {"l3": {"read_limit_gbps": -1}}}, "cache.l3.read_limit_gbps: must be >= 0"),
        (["a"], "top level must be a mapping"),
    ],
)
def test_bad_values_name_the_key_and_file(data, message):
    with pytest.raises(ConfigError, match=message) as e:
        from_dict(data, "my.yaml")
    assert "my.yaml" in str(e.value)


def test_override_and_tier_tokens():
    cfg = override(Config(), {"cache.l3.path": "/tmp/x", "server.port": 9000})
    assert cfg.cache.l3.path == "/tmp/x" and cfg.server.port == 9000
    with pytest.raises(ConfigError, match="unknown key 'cache.nope'"):
        override(Config(), {"cache.nope": 1})
    cfg = set_tier_tokens(cfg, "disk", 4096)
    sizes = resolve_sizes(cfg, 100)
    assert sizes.disk_pages == 4096 // 16 and sizes.bytes("disk") == 4096 * 100
    assert resolve_sizes(set_tier_tokens(cfg, "host", 0), 100).host_pages == 0
    with pytest.raises(ConfigError, match="at least one page"):
        resolve_sizes(override(Config(), {"cache.device.size_tokens": 4}), 100)


def test_cli_config_command(tmp_path, capsys):
    assert main(["config", "configs/default.yaml"]) == 0
    out = capsys.readouterr().out
    assert "device: 256 pages, 4096 tokens" in out and "disk:" in out and "valid" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  page_size: 16\n  colour: blue\n")
    assert main(["config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'cache.colour'" in err and str(bad) in err
    bad.write_text("cache: [unclosed\n")
    assert main(["config", str(bad)]) == 2
    assert "invalid YAML" in capsys.readouterr().err
    assert main(["config", str(tmp_path / "missing.yaml")]) == 2


def test_cli_reports_bad_l3_path_cleanly(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = main(["generate", "--model", "random:tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                 "--l3-path", str(afile)])
    assert code == 2
    err = capsys.readouterr().err
    assert "L3 store error" in err and str(afile) in err and "not a directory" in err
    code = main(["generate", "--model", "random:tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "1",
                 "--l3-path", str(tmp_path / "missing" / "x")])
    assert code == 2 and "parent directory" in capsys.readouterr().err


def test_cli_reports_a_host_tier_larger_than_memory_cleanly(capsys, monkeypatch):
    from tiers import host_pool

    monkeypatch.setattr(host_pool, "available_memory_bytes", lambda: 1 << 20)  # 1 MiB available
    code = main(["generate", "--model", "random:tiny", "--device", "cpu", "--prompt", "hi", "--max-tokens", "1"])
    assert code == 2
    err = capsys.readouterr().err
    assert "host memory error: the host pool needs" in err and "lower cache.host.size_gib" in err


def test_l3_inspect_cli(tmp_path, capsys):
    from tiers.l3 import L3Store

    with L3Store(tmp_path / "s", 8 * 4096, 4096, bytes(16)) as store:
        import torch

        assert store.write_pages([b"k" * 16], [torch.full((4096,), 7, dtype=torch.uint8)]) == [True]
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "s"), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "pages" in out and "1 / 8" in out
    assert main(["l3", "inspect", "--l3-path", str(tmp_path / "nothing")]) == 2


def test_serve_set_overrides_any_key_last():
    import argparse

    from hicache.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--config", "configs/h200-llama8b.yaml", "--no-l3", "--chunk-tokens", "512",
                              "--set", "cache.write_policy.defer_above_free=1", "--set", "scheduler.chunk_tokens=1024",
                              "--set", "cache.load_policy.prefetch=false"])
    cfg = serve_cli.build_config(args)
    assert cfg.cache.write_policy.defer_above_free == 1.0 and cfg.scheduler.chunk_tokens == 1024
    assert cfg.cache.load_policy.prefetch is False and cfg.cache.l3.path is None
    for bad, message in [("cache.nope=1", "unknown key 'cache.nope'"), ("cache.page_size", "expected KEY=VALUE"),
                         ("cache.write_policy.defer_above_free=2", r"must be in \[0, 1\]"),
                         ("scheduler.chunk_tokens=[1", "not valid YAML")]:
        args = parser.parse_args(["serve", "--set", bad])
        with pytest.raises(ConfigError, match=message):
            serve_cli.build_config(args)


def test_serve_trace_steps_window():
    from hicache.server import cli as serve_cli

    assert serve_cli._trace_window("100:20") == (100, 20)
    assert serve_cli._trace_window("0:1") == (0, 1)
    for bad in ("100", "a:3", "5:0", "-1:4", "3:"):
        with pytest.raises(ConfigError, match="--trace-steps"):
            serve_cli._trace_window(bad)


def test_serve_checks_the_port_and_the_l3_path_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import socket

    import hicache.engine.builder as builder

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the port and the L3 path were checked")

    monkeypatch.setattr(builder, "build_engine", no_model)
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    try:
        code = main(["serve", "--config", "configs/default.yaml", "--model", "random:tiny", "--port", str(port),
                     "--no-l3"])
        assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    finally:
        busy.close()
    afile = tmp_path / "afile"
    afile.write_text("x")
    code = main(["serve", "--config", "configs/default.yaml", "--model", "random:tiny", "--port", str(port),
                 "--l3-path", str(afile)])  # the port is free again
    err = capsys.readouterr().err
    assert code == 2 and "L3 store error" in err and "not a directory" in err
    code = main(["serve", "--config", "configs/default.yaml", "--model", "random:tiny", "--port", str(port),
                 "--no-l3", "--trace-log", str(afile / "x.jsonl")])  # under a file: no directory to write in
    err = capsys.readouterr().err
    assert code == 2 and "server.trace_log (--trace-log): cannot append to" in err and "Traceback" not in err


def test_a_bad_write_policy_on_the_command_line_names_the_key():
    from hicache.config import Config, ConfigError, override

    with pytest.raises(ConfigError, match=r"command line: cache.write_policy.l3_host_share: must be in \(0, 1\]"):
        override(Config(), {"cache.write_policy.l3_host_share": 0.0})
    with pytest.raises(ConfigError, match=r"cache.write_policy.host_to_disk: 'later' is not one of"):
        override(Config(), {"cache.write_policy.host_to_disk": "later"})


def test_config_command_masks_secrets(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("server:\n  api_key: sk-very-secret-key\n"
                    "cache:\n  remote:\n    url: redis://alice:url-secret@127.0.0.1:6390/0\n    password: pw-secret\n")
    assert main(["config", str(path)]) == 0
    out = capsys.readouterr().out
    for secret in ("sk-very-secret-key", "url-secret", "pw-secret"):
        assert secret not in out
    assert "api_key: '********'" in out and "password: '********'" in out
    assert "redis://alice:********@127.0.0.1:6390/0" in out


def test_an_unknown_model_is_a_config_error_naming_the_known_ones(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: nosuchmodel\n")
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "config error" in err and "model.name: unknown model 'nosuchmodel'" in err
    assert "smollm2-135m-instruct" in err and "random:llama-3.1-8b" in err and "Traceback" not in err
    assert main(["generate", "--model", "nosuchmodel", "--prompt", "hi"]) == 2
    assert "model.name: unknown model 'nosuchmodel'" in capsys.readouterr().err


def test_a_missing_tenants_file_is_a_config_error(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(f"server:\n  tenants_file: {tmp_path / 'nope.yaml'}\n")
    assert main(["config", str(path)]) == 2
    assert "server.tenants_file:" in capsys.readouterr().err


def test_a_number_in_exponent_notation_is_a_number(tmp_path):
    from hicache.config import load_config

    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  host:\n    size_gib: 1e3\n  l3:\n    path: /tmp/l3\n    size_gib: 2.5E+2\n")
    cfg = load_config(path)  # YAML 1.1 reads `1e3` as a string
    assert cfg.cache.host.size_gib == 1000.0 and cfg.cache.l3.size_gib == 250.0
    path.write_text("cache:\n  host:\n    size_gib: 1e3x\n")
    with pytest.raises(ConfigError, match="cache.host.size_gib: expected a number, got '1e3x'"):
        load_config(path)
