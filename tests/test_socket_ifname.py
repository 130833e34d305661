"""Which interface Gloo and NCCL are pinned to on a worker (rayapp.train.socket_ifname), on this
machine's real interfaces. The multi-host proof is tests/test_hosts_cluster.py."""

from __future__ import annotations

import os

import pytest

from rayapp.train import socket_ifname
from rayapp.train.socket_ifname import SOCKET_IFNAME_VARS


@pytest.fixture
def clean_env(monkeypatch):
    # setenv first, so that undoing it restores the variable's absence as well:
    # pin_socket_interfaces sets it behind monkeypatch's back, and a value left over (this
    # process's interface, not the test cluster's) would reach every rayapp the later tests
    # start, as a user's choice
    for variable in SOCKET_IFNAME_VARS:
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    return monkeypatch


def test_loopback_addresses_are_on_lo():
    assert socket_ifname.interface_holding("127.0.0.1") == "lo"


def test_other_loopback_addresses_are_on_lo_too():
    # lo lists only 127.0.0.1 but answers for 127.0.0.0/8: the embedded cluster's nodes live there
    assert socket_ifname.interface_holding("127.0.0.3") == "lo"


def test_an_address_no_interface_holds_gives_none():
    assert socket_ifname.interface_holding("198.18.255.254") is None


def test_both_libraries_get_the_interface_of_the_nodes_address(clean_env):
    import ray

    expected = socket_ifname.interface_holding(ray.util.get_node_ip_address())
    assert expected is not None
    socket_ifname.pin_socket_interfaces()
    assert [os.environ[v] for v in SOCKET_IFNAME_VARS] == [expected, expected]
    assert socket_ifname.socket_ifnames() == expected


def test_a_users_choice_is_kept_and_recorded(clean_env):
    clean_env.setenv("GLOO_SOCKET_IFNAME", "bond0")
    socket_ifname.pin_socket_interfaces()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "bond0"
    assert socket_ifname.socket_ifnames().startswith("gloo:bond0/nccl:")


def test_nothing_set_is_recorded_as_empty(clean_env):
    assert socket_ifname.socket_ifnames() == ""


def test_the_torch_config_pins_before_ray_trains_process_group_forms():
    import cloudpickle
    from ray.train.torch import TorchConfig

    from rayapp.train.torch_config import PinnedInterfaceBackend, PinnedInterfaceTorchConfig

    config = cloudpickle.loads(cloudpickle.dumps(PinnedInterfaceTorchConfig(backend="gloo")))
    assert (config.backend, config.timeout_s) == ("gloo", TorchConfig().timeout_s)
    assert config.backend_cls is PinnedInterfaceBackend
    assert issubclass(PinnedInterfaceBackend, TorchConfig().backend_cls)
