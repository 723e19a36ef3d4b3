"""Multi-node and --export settings of ``psctl local`` and the allreduce rendezvous settings:
bad values are refused with a message naming the flag or variable, before anything starts."""

from __future__ import annotations

import pytest

import psworker
from psctl import main as psctl_main
from psctl.launch import LocalConfig
from psctl.nodes import NodesConfig
from pswire.errors import ConfigError
from psworker.ring.rendezvous import RendezvousSettings


def test_nodes_config_reads_fixed_and_elastic_ranges():
    fixed = NodesConfig("2", 1, "10.0.0.1:29400")
    assert (fixed.bounds, fixed.elastic, fixed.host, fixed.port) == (
        (2, 2),
        False,
        "10.0.0.1",
        29400,
    )
    assert NodesConfig("1:4", 3, "h:1").elastic


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("2", 2, "h:1"), r"--node-rank must be in \[0, 2\)"),
        (("1:4", 4, "h:1"), r"--node-rank must be in \[0, 4\)"),
        (("2", 0, "h"), "--rdzv must be HOST:PORT"),
        (("2", 0, "h:70000"), "--rdzv must be HOST:PORT"),
        (("3:2", 0, "h:1"), "1 <= MIN <= MAX"),
        (("x", 0, "h:1"), "--nnodes"),
        (("2", 0, "h:1", 30.0, 1.0), r"--node-timeout must be >= 2 seconds"),
        (("2", 0, "h:1", 0.0), "--join-timeout must be > 0"),
    ],
)
def test_bad_node_settings_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        NodesConfig(*args)


def test_local_configs_refuse_what_cannot_work():
    nodes = NodesConfig("1:2", 0, "h:1")
    for kwargs, message in (
        ({"mode": "allreduce", "export": "m.pt"}, "--export reads the final model from the shards"),
        ({"elastic": "1:2", "nodes": nodes}, "give an elastic range as --nnodes MIN:MAX"),
        ({"mode": "allreduce", "nodes": nodes}, r"\(elastic\) needs a parameter-server mode"),
    ):
        with pytest.raises(ValueError, match=message):
            LocalConfig(("x",), **kwargs)
    assert LocalConfig(("x",), export="m.pt").export == "m.pt"


def test_node_flags_need_each_other(capsys):
    for argv, message in (
        (["local", "--nnodes", "2", "--", "x"], "--nnodes needs --rdzv"),
        (["local", "--rdzv", "h:1", "--", "x"], "--rdzv and --node-rank need --nnodes"),
    ):
        with pytest.raises(SystemExit):
            psctl_main.main(argv)
        assert message in capsys.readouterr().err


def test_rendezvous_settings_come_from_master_addr_and_port():
    env = {"MASTER_ADDR": "h", "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    settings = RendezvousSettings.from_env(1, 2, 30.0, env)
    assert (
        settings is not None
        and settings.agent_store
        and (settings.host, settings.port)
        == (
            "h",
            29500,
        )
    )
    assert RendezvousSettings.from_env(0, 2, 30.0, {}) is None
    for bad, message in (
        ({"MASTER_ADDR": "h"}, "set both"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "0"}, r"\$MASTER_PORT='0' is not a port number"),
    ):
        with pytest.raises(ConfigError, match=message):
            RendezvousSettings.from_env(0, 2, 30.0, bad)


def test_allreduce_without_ring_addresses_or_a_rendezvous_says_what_to_set(monkeypatch):
    for name in ("MASTER_ADDR", "MASTER_PORT", "TF_CONFIG", "PS_SHARDS", "PS_WORKER_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"set \$MASTER_ADDR and \$MASTER_PORT"):
        psworker.connect(mode="allreduce")
