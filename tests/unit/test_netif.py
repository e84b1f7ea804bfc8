"""world.interface: the picker routes to the rendezvous endpoint and maps the source address to an interface; a bad
name is one line naming the field, the value and the interfaces that exist."""
from __future__ import annotations

import socket

import pytest

from dtk import netif
from dtk.errors import DtkError


def test_the_route_to_loopback_leaves_from_lo():
    assert netif.route_source("127.0.0.1", 29500) == "127.0.0.1"
    name, why = netif.pick(None, endpoint="127.0.0.1:29500")
    assert name == "lo" and why == "routes to 127.0.0.1:29500"
    assert netif.pick(None, endpoint="localhost:29500")[0] == "lo"


def test_a_named_interface_that_exists_is_taken_as_is():
    assert netif.pick("lo", endpoint="10.9.9.9:1") == ("lo", "set by world.interface")
    assert netif.backend_env("lo", endpoint="127.0.0.1:29500", multi_node=False) == {
        "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def test_one_node_and_nothing_named_leaves_the_backend_alone():
    assert netif.backend_env(None, endpoint="127.0.0.1:29500", multi_node=False) == {}


def test_a_bad_name_is_one_line_with_the_interfaces_that_exist():
    names = sorted(n for _, n in socket.if_nameindex())
    with pytest.raises(DtkError) as e:
        netif.pick("eth9-fast", endpoint="127.0.0.1:29500")
    assert e.value.lines == [f"world.interface: got 'eth9-fast'; interfaces on this host: {', '.join(names)}"]


def test_a_faster_real_interface_is_named_virtual_ones_are_not():
    slow = netif.Interface(name="eno1", addresses=("192.168.0.5",), speed_mbps=1000, up=True)
    found = {i.name: i for i in [
        slow,
        netif.Interface(name="ens3f0", addresses=("10.0.0.5",), speed_mbps=100000, up=True),
        netif.Interface(name="docker0", addresses=("172.17.0.1",), speed_mbps=400000, up=True),
        netif.Interface(name="ens3f1", addresses=(), speed_mbps=200000, up=True),  # no address: not usable
    ]}
    assert netif._faster(slow, found).name == "ens3f0"
    assert netif._faster(found["ens3f0"], found) is None


def test_an_endpoint_naming_this_host_never_binds_loopback():
    # Node 0 of a Slurm job gets its own name as the endpoint; many hosts resolve their own name to 127.0.x.1, but
    # the other nodes reach it over the network: binding lo there would leave node 0 unreachable.
    host = socket.gethostname()
    try:
        name, why = netif.pick(None, endpoint=f"{host}:29500")
    except DtkError as e:  # a host without a default route (a bare namespace) must say so, not bind lo
        assert "no default route" in e.lines[0]
        return
    assert name != "lo"
    if netif._loopback(socket.gethostbyname(host)):
        assert why == f"{host} is this host (it resolves to loopback here); the interface of the default route"


def test_the_choice_is_printed_once_and_a_faster_unused_interface_is_warned_about(monkeypatch, capsys, caplog):
    # this host's own interfaces cannot be chosen: the picker reads a described machine (loopback held by "eno1")
    found = {"eno1": netif.Interface(name="eno1", addresses=("127.0.0.1",), speed_mbps=1000, up=True),
             "ens3f0": netif.Interface(name="ens3f0", addresses=("10.0.0.5",), speed_mbps=100000, up=True)}
    monkeypatch.setattr(netif, "interfaces", lambda: found)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    netif._announced.cache_clear()
    for _ in range(3):  # the launcher asks once per rank
        env = netif.backend_env(None, endpoint="127.0.0.1:29500", multi_node=True)
    netif._announced.cache_clear()
    assert env == {"GLOO_SOCKET_IFNAME": "eno1", "NCCL_SOCKET_IFNAME": "eno1"}
    assert capsys.readouterr().out == ("network: ranks bind to eno1 (127.0.0.1, 1,000 Mb/s); routes to "
                                       "127.0.0.1:29500\n")
    assert [r.getMessage() for r in caplog.records] == [
        "network: ens3f0 (100,000 Mb/s) looks faster than eno1 (1,000 Mb/s) and is not used; if the other hosts are "
        "reachable through it, set world.interface=ens3f0"]
