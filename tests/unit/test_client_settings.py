"""A worker's settings are one frozen, checked object: argument, then ``PS_*`` variable, then
default, decided in ``ClientSettings.from_env`` alone; ``connect()`` and the clients use it,
the links get their part of it, and the reference's table is generated from its fields."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

import psworker
from pswire import envnames
from pswire.security import ClientSecurity
from psworker.settings import DEFAULT_TIMEOUT_S, ClientSettings, fields_table

REPO = Path(__file__).resolve().parents[2]
ADDRESS = ("127.0.0.1:7001",)
# Each setting read from a variable: (field, variable, its text, the value it gives, an
# argument that wins over it).
FROM_ENV = [
    ("mode", "PS_MODE", "async", "async", "ssp"),
    ("staleness", "PS_STALENESS", "3", 3, 5),
    ("compression", "PS_COMPRESSION", "fp16", "fp16", "bf16"),
    ("job_id", "PS_JOB_ID", "job-a", "job-a", "job-b"),
    ("replay_bytes", "PS_REPLAY_BYTES", "1024", 1024, 2048),
    ("stall_warning_s", "PS_STALL_WARNING", "2.5", 2.5, 0.0),
    ("part_bytes", "PS_PART_BYTES", "0", 0, 2 << 20),
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PS_* variable of the calling shell reaches these tests."""
    for name in envnames.KNOWN:
        monkeypatch.delenv(name, raising=False)


def test_defaults_and_frozen() -> None:
    settings = ClientSettings(addresses=list(ADDRESS))  # type: ignore[arg-type]
    assert settings.addresses == ADDRESS  # a list becomes a tuple: nothing to change later
    assert (settings.worker_id, settings.num_workers, settings.mode) == (0, 1, "sync")
    assert settings.timeout == DEFAULT_TIMEOUT_S and settings.retry_for == DEFAULT_TIMEOUT_S
    assert settings.security == ClientSecurity() and not settings.elastic
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(("name", "env", "text", "value", "argument"), FROM_ENV)
def test_argument_then_variable_then_default(
    monkeypatch: pytest.MonkeyPatch, name: str, env: str, text: str, value: Any, argument: Any
) -> None:
    default = getattr(ClientSettings(addresses=ADDRESS), name)
    extra = {"staleness": 1} if name == "mode" else {}  # ssp with a staleness too
    mode = {"mode": "ssp"} if name == "staleness" else {}  # staleness counts in ssp only
    assert getattr(ClientSettings.from_env(ADDRESS, 0, 1, **mode), name) == default
    monkeypatch.setenv(env, text)
    assert getattr(ClientSettings.from_env(ADDRESS, 0, 1, **mode), name) == value
    given = ClientSettings.from_env(ADDRESS, 0, 1, **{**mode, **extra, name: argument})
    assert getattr(given, name) == argument
    monkeypatch.setenv(env, "")  # empty is unset
    assert getattr(ClientSettings.from_env(ADDRESS, 0, 1, **mode), name) == default


def test_security_from_arguments_then_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PS_TOKEN", "from-env-token-123")
    assert ClientSettings.from_env(ADDRESS, 0, 1).security.token == "from-env-token-123"
    given = ClientSettings.from_env(ADDRESS, 0, 1, token="argument-token-456")
    assert given.security.token == "argument-token-456"
    ca = tmp_path / "ca.pem"
    monkeypatch.setenv("PS_TLS_CA", str(ca))
    assert ClientSettings.from_env(ADDRESS, 0, 1).security.ca == ca


@pytest.mark.parametrize(
    ("env", "text"),
    [
        ("PS_STALENESS", "two"),
        ("PS_REPLAY_BYTES", "lots"),
        ("PS_STALL_WARNING", "soon"),
        ("PS_MODE", "fast"),
        ("PS_PART_BYTES", "1MiB"),
    ],
)
def test_a_variable_that_does_not_convert_is_named(
    monkeypatch: pytest.MonkeyPatch, env: str, text: str
) -> None:
    monkeypatch.setenv(env, text)
    with pytest.raises(psworker.ConfigError, match=rf"\${env}='{text}'"):
        ClientSettings.from_env(ADDRESS, 0, 1, mode="ssp" if env != "PS_MODE" else None)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"addresses": ()}, "connect needs at least one shard address"),
        ({"mode": "bogus"}, "mode must be one of ('sync', 'async', 'ssp'), got 'bogus'"),
        ({"mode": "local"}, "mode must be one of"),
        ({"worker_id": 2, "num_workers": 2}, "worker_id 2 must be in [0, 2)"),
        ({"compression": "zip"}, "compression must be one of (None, 'fp16', 'bf16'), got 'zip'"),
        ({"mode": "ssp", "staleness": -1}, "staleness must be >= 0, got -1"),
        ({"timeout": 0}, "timeout must be > 0, got 0"),
        ({"chunk_bytes": -5}, "chunk_bytes must be > 0, got -5"),
        ({"split_bytes": 0}, "split_bytes must be > 0, got 0"),
        ({"part_bytes": -1}, "part_bytes must be >= 0, got -1"),
        (
            {"min_workers": 3, "max_workers": 2, "num_workers": 2},
            "an elastic job needs 1 <= min_workers <= max_workers, got 3:2",
        ),
        (
            {"min_workers": 1, "max_workers": 2, "num_workers": 2, "worker_id": 2},
            "worker_id 2 must be in [0, max_workers=2) in an elastic job",
        ),
        (
            {"min_workers": 1, "max_workers": 4, "num_workers": 2},
            "an elastic job's num_workers is its max_workers (4), got num_workers=2",
        ),
    ],
)
def test_bad_values_are_config_errors_naming_them(given: dict[str, Any], message: str) -> None:
    with pytest.raises(psworker.ConfigError) as info:
        ClientSettings(**{"addresses": ADDRESS, **given})
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_an_unknown_setting_is_named() -> None:
    with pytest.raises(psworker.ConfigError, match=r"unknown client settings \['chunk_byte'\]"):
        ClientSettings.from_env(ADDRESS, 0, 1, chunk_byte=5)


def test_staleness_counts_in_ssp_only() -> None:
    assert ClientSettings(addresses=ADDRESS, mode="ssp", staleness=2).staleness == 2
    assert ClientSettings(addresses=ADDRESS, mode="sync", staleness=2).staleness == 0


def test_each_link_gets_its_part_of_the_settings() -> None:
    settings = ClientSettings(
        addresses=ADDRESS, worker_id=1, num_workers=3, timeout=9.0, chunk_bytes=4096
    )
    config = settings.link_config("sess")
    assert (config.worker_id, config.num_workers, config.timeout) == (1, 3, 9.0)
    assert (config.retry_s, config.chunk_bytes, config.session) == (9.0, 4096, "sess")
    assert config.replay_bytes == settings.replay_bytes
    assert ClientSettings(addresses=ADDRESS, retry_s=0.5).link_config("").retry_s == 0.5


def test_a_client_class_takes_only_settings_of_its_kind_of_job() -> None:
    elastic = ClientSettings(addresses=ADDRESS, num_workers=4, min_workers=1, max_workers=4)
    with pytest.raises(psworker.ConfigError, match="need ElasticPSClient"):
        psworker.PSClient(elastic)
    with pytest.raises(psworker.ConfigError, match="ElasticPSClient needs the settings"):
        psworker.ElasticPSClient(ClientSettings(addresses=ADDRESS))


def test_connect_builds_the_clients_settings_from_keywords_and_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PS_STALENESS", "4")
    monkeypatch.setenv("PS_JOB_ID", "the-job")
    client = psworker.connect(
        ["127.0.0.1:7001", "127.0.0.1:7002"],
        worker_id=1,
        num_workers=3,
        mode="ssp",
        timeout=7.0,
        chunk_bytes=1 << 16,
        heartbeat_s=0,
    )
    try:
        assert isinstance(client, psworker.PSClient)
        assert client.settings == ClientSettings(
            addresses=("127.0.0.1:7001", "127.0.0.1:7002"),
            worker_id=1,
            num_workers=3,
            mode="ssp",
            staleness=4,
            timeout=7.0,
            chunk_bytes=1 << 16,
            heartbeat_s=0,
            job_id="the-job",
        )
        assert (client.staleness, client.timeout, client.identity.value) == (4, 7.0, "the-job")
        assert [link.chunk_bytes for link in client.links] == [1 << 16] * 2
        # Each link and transport holds the deadline it was built with: a new one set on the
        # client would reach some calls only, so setting it is refused, naming the way.
        with pytest.raises(AttributeError, match=r"fixed when it connects \(now 7s\): connect"):
            client.timeout = 1.0
        assert client.timeout == 7.0 and [link.timeout for link in client.links] == [7.0] * 2
    finally:
        client.close()
    elastic = psworker.connect(["127.0.0.1:7001"], worker_id=2, elastic="2:5", heartbeat_s=0)
    try:
        assert isinstance(elastic, psworker.ElasticPSClient)
        settings = elastic.settings
        assert (settings.min_workers, settings.max_workers, settings.num_workers) == (2, 5, 5)
        assert (elastic.min_workers, elastic.max_workers, elastic.num_workers) == (2, 5, 5)
    finally:
        elastic.close()
    with pytest.raises(psworker.ConfigError, match=r"unknown client settings \['bucket_bytes'\]"):
        psworker.connect(["127.0.0.1:7001"], worker_id=0, num_workers=1, bucket_bytes=5)


def test_the_reference_table_has_every_field_and_variable() -> None:
    names = [f.name for f in dataclasses.fields(ClientSettings)]
    rows = fields_table()
    assert [r[0] for r in rows] == names
    assert all(doc for *_, doc in rows)
    for _, env, _, _, _ in FROM_ENV:
        assert env in envnames.KNOWN
        assert sum(f"`${env}`" in r[1] for r in rows) == 1, env
    spec = importlib.util.spec_from_file_location("generated", REPO / "docs/hooks/generated.py")
    assert spec is not None and spec.loader is not None
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    page = generated.on_page_markdown("<!-- settings: psworker -->")
    assert page.count("\n| `") == len(names)
    assert "| `chunk_bytes` |  | 4 MiB |" in page
    assert "<!-- settings: psworker -->" in (REPO / "docs/reference/sdk.md").read_text()
