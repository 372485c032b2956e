"""Settings precedence and validation, API keys (hashing, auth, ``kvscope keys create``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from kvscope.gateway.auth import Authenticator, generate_key, hash_key
from kvscope.gateway.cli import _gateway_parser, _overrides, keys_main
from kvscope.gateway.errors import AuthenticationFailed, PermissionDenied
from kvscope.gateway.settings import ApiKeyConfig, KeyLimits, load_settings, parse_key_hash

DIGEST = hash_key("sk-test")


def test_precedence_defaults_file_env_cli(tmp_path: Path) -> None:
    path = tmp_path / "gw.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "port": 9000,
                "upstreams": [{"url": "http://a:1", "models": ["m"]}],
                "timeouts": {"keepalive_s": 5, "idle_s": 30},
                "api_keys": [
                    {"name": "alice", "sha256": DIGEST, "models": ["m"], "limits": {"requests_per_minute": 7}}
                ],
                "default_limits": {"max_tokens": 512},
            }
        )
    )
    env = {
        "KVSCOPE_GATEWAY_PORT": "9100",
        "KVSCOPE_GATEWAY_REDIS_URL": "redis://r:6379/0",
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://otel:4318",
        "OTEL_SERVICE_NAME": "gw-env",
    }
    args = _gateway_parser().parse_args(["--port", "9200", "--keepalive", "2", "--tokenizer", "m=/tok"])
    s = load_settings(path, _overrides(args), env=env)
    # OTEL_EXPORTER_OTLP_ENDPOINT is read by the OTel SDK (kvscope/common/otel_env.py); OTEL_SERVICE_NAME is
    # the default
    assert (s.host, s.port, s.redis_url, s.tracing.otlp_endpoint) == (
        "127.0.0.1",
        9200,
        "redis://r:6379/0",
        None,
    )
    assert s.service_name == "gw-env"
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), "service_name": "gw-file"}))
    assert load_settings(path, env=env).service_name == "gw-file"  # the config file overrides OTel's variable
    assert (s.timeouts.keepalive_s, s.timeouts.idle_s, s.timeouts.total_s) == (2.0, 30.0, 1800.0)
    assert (
        s.upstreams[0].url == "http://a:1"
        and s.upstreams[0].models == ("m",)
        and s.upstreams[0].label == "a:1"
    )
    assert s.models[0].name == "m" and s.models[0].tokenizer == "/tok"
    assert s.api_keys[0].limits.merged(s.default_limits) == KeyLimits(max_tokens=512, requests_per_minute=7)


def test_toml_file_and_env_upstreams(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    log = tmp_path / "x.jsonl"
    path.write_text(f'host = "127.0.0.1"\n[logs]\nfile = "{log}"\n')
    s = load_settings(
        path,
        env={
            "KVSCOPE_GATEWAY_UPSTREAMS": "http://a:1, http://b:2",
            "KVSCOPE_GATEWAY_API_KEY_HASHES": f"bob:{DIGEST}",
        },
    )
    assert [u.url for u in s.upstreams] == ["http://a:1", "http://b:2"]
    assert s.logs.file == str(log) and s.api_keys[0].name == "bob"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"upstreams": []}, "at least one upstream"),
        ({"upstreams": [{"url": "a:1"}]}, "must start with http"),
        ({"upstreams": [{"url": "http://a"}], "tiemouts": {}}, "unknown field `tiemouts`"),
        ({"upstreams": [{"url": "http://a"}], "port": "x"}, "Expected `int`, got `str` - at `$.port`"),
        ({"upstreams": [{"url": "http://a"}], "api_keys": [{"name": "a", "sha256": "zz"}]}, "64 hex digits"),
        (
            {"upstreams": [{"url": "http://a"}], "default_limits": {"max_concurrent": 0}},
            "max_concurrent must be >= 1",
        ),
        (
            {"upstreams": [{"url": "http://a"}], "host": "0.0.0.0"},
            "refusing to serve 0.0.0.0 without API keys",
        ),
    ],
)
def test_invalid_settings_name_the_problem(raw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("$", r"\$").replace("`", "`")):
        load_settings(None, raw, env={})


def test_non_loopback_needs_keys_or_explicit_opt_out() -> None:
    up = [{"url": "http://a"}]
    assert load_settings(None, {"upstreams": up, "host": "::1"}, env={}).auth_enabled is False
    assert load_settings(None, {"upstreams": up, "host": "0.0.0.0", "allow_unauthenticated": True}, env={})
    keyed = load_settings(
        None, {"upstreams": up, "host": "0.0.0.0", "api_keys": [{"name": "a", "sha256": DIGEST}]}, env={}
    )
    assert keyed.auth_enabled


def test_authenticator_constant_time_lookup_and_errors() -> None:
    keys = (
        ApiKeyConfig(name="alice", sha256=hash_key("sk-a"), models=("m1",)),
        ApiKeyConfig(name="bob", sha256=hash_key("sk-b"), limits=KeyLimits(max_concurrent=1)),
    )
    auth = Authenticator(keys, KeyLimits(requests_per_minute=10))
    alice = auth.authenticate("Bearer sk-a")
    assert (alice.key_id, alice.models, alice.limits.requests_per_minute) == ("alice", frozenset({"m1"}), 10)
    bob = auth.authenticate("bearer  sk-b")
    assert bob.key_id == "bob" and bob.limits == KeyLimits(requests_per_minute=10, max_concurrent=1)
    for header, text in ((None, "Missing API key"), ("Basic xyz", "Malformed"), ("Bearer sk-c", "Incorrect")):
        with pytest.raises(AuthenticationFailed, match=text) as err:
            auth.authenticate(header)
        assert err.value.status == 401 and err.value.body()["error"]["code"] == "invalid_api_key"
    with pytest.raises(PermissionDenied) as denied:
        auth.check_model(alice, "m2")
    assert denied.value.status == 403 and denied.value.param == "model"
    auth.check_model(bob, "m2")
    anonymous = Authenticator((), KeyLimits()).authenticate(None)
    assert anonymous.key_id == "anonymous" and not anonymous.authenticated


def test_generated_keys_are_unique_and_hash_is_sha256() -> None:
    keys = {generate_key() for _ in range(50)}
    assert len(keys) == 50 and all(k.startswith("sk-kvs-") and len(k) == 50 for k in keys)
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_trusted_proxies_from_file_env_and_cli_are_validated() -> None:
    base = {"upstreams": [{"url": "http://a"}]}
    assert load_settings(None, base, env={}).trusted_proxies == ()
    env = {"KVSCOPE_GATEWAY_TRUSTED_PROXIES": "10.0.0.0/8, ::1"}
    assert load_settings(None, base, env=env).trusted_proxies == ("10.0.0.0/8", "::1")
    flags = _overrides(
        _gateway_parser().parse_args(["--trusted-proxy", "192.168.1.7", "--trusted-proxy", "fd00::/8"])
    )
    assert load_settings(None, {**base, **flags}, env=env).trusted_proxies == ("192.168.1.7", "fd00::/8")
    with pytest.raises(ValueError, match="trusted_proxies: 'proxy.local' is not an IP address or network"):
        load_settings(None, {**base, "trusted_proxies": ["proxy.local"]}, env={})


def _created(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, dict, str]:
    assert keys_main(["create", *args]) == 0
    out = capsys.readouterr()
    key, line = out.out.splitlines()
    assert key.startswith("sk-kvs-") and key not in out.err
    return key, yaml.safe_load(line)[0], out.err


def test_keys_create_prints_key_once_and_a_loadable_config_line(capsys: pytest.CaptureFixture[str]) -> None:
    key, entry, err = _created(capsys, "--name", "carol", "--models", "m1")
    assert entry == {"name": "carol", "sha256": hash_key(key), "models": ["m1"]}
    settings = load_settings(None, {"upstreams": [{"url": "http://a"}], "api_keys": [entry]}, env={})
    assert Authenticator(settings.api_keys, KeyLimits()).authenticate(f"Bearer {key}").key_id == "carol"


def test_keys_create_output_cannot_lose_the_model_restriction(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 19 point 3: every way of configuring the key that the output offers keeps ``--models``."""
    key, entry, err = _created(capsys, "--name", "carol", "--models", "gpt-x, org/m:1 #a")
    assert entry["models"] == ["gpt-x", "org/m:1 #a"]  # names YAML would mangle survive (JSON flow mapping)
    assert "--api-key-hash" not in err.replace("(no --api-key-hash form", "")
    settings = load_settings(None, {"upstreams": [{"url": "http://a"}], "api_keys": [entry]}, env={})
    auth = Authenticator(settings.api_keys, KeyLimits())
    carol = auth.authenticate(f"Bearer {key}")
    auth.check_model(carol, "org/m:1 #a")
    with pytest.raises(PermissionDenied):
        auth.check_model(carol, "other-model")
    assert (
        keys_main(["create", "--name", "dave", "--models", " , "]) == 2
    )  # an empty list is not "all models"


def test_keys_create_offers_the_hash_flag_only_for_unrestricted_keys(
    capsys: pytest.CaptureFixture[str],
) -> None:
    key, entry, err = _created(capsys, "--name", "erin")
    assert entry == {"name": "erin", "sha256": hash_key(key)}
    flag = f"--api-key-hash erin:{hash_key(key)}"
    assert flag in err
    via_flag = load_settings(
        None, {"upstreams": [{"url": "http://a"}], "api_keys": [parse_key_hash(flag.split()[1])]}, env={}
    )
    via_config = load_settings(None, {"upstreams": [{"url": "http://a"}], "api_keys": [entry]}, env={})
    assert via_flag.api_keys == via_config.api_keys


def test_keys_create_carries_the_keys_service_tier(capsys: pytest.CaptureFixture[str]) -> None:
    key, entry, err = _created(capsys, "--name", "batch", "--service-tier", "flex")
    assert entry == {"name": "batch", "sha256": hash_key(key), "service_tier": "flex"}
    assert "(no --api-key-hash form: that flag cannot carry the service tier)" in err
    settings = load_settings(None, {"upstreams": [{"url": "http://a"}], "api_keys": [entry]}, env={})
    assert Authenticator(settings.api_keys, KeyLimits()).authenticate(f"Bearer {key}").service_tier == "flex"


@pytest.mark.parametrize("name", ["", "ok:colon", "two\nlines", "sp ace", "-dash-first", "x" * 65])
def test_keys_create_refuses_names_the_gateway_could_not_load(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keys_main(["create", f"--name={name}"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith(f"kvscope keys: api key name {name!r} must be 1-64 of ")
    with pytest.raises(ValueError, match="must be 1-64 of"):
        ApiKeyConfig(name=name, sha256="0" * 64)


@pytest.mark.parametrize("name", ["alice", "svc.batch-2", "team_a@prod", "x" * 64])
def test_valid_key_names_round_trip_through_the_hash_flag(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keys_main(["create", "--name", name]) == 0
    flag = next(line for line in capsys.readouterr().err.splitlines() if "--api-key-hash" in line)
    item = flag.split("--api-key-hash ", 1)[1]
    assert ApiKeyConfig(**parse_key_hash(item)).name == name


@pytest.mark.parametrize(
    ("overrides", "env", "message"),
    [
        ({"port": -1}, {}, "invalid gateway config: Expected `int` >= 0 - at `$.port`"),
        (
            {},
            {"KVSCOPE_GATEWAY_PORT": "70000"},
            "invalid gateway config: Expected `int` <= 65535 - at `$.port`",
        ),
    ],
)
def test_a_port_outside_0_65535_is_a_config_error_not_a_bind_traceback(overrides, env, message) -> None:
    with pytest.raises(ValueError) as caught:
        load_settings(None, overrides, env=env)
    assert str(caught.value) == message
