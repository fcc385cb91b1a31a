"""Where rank 0's coordinator store listens and what it advertises (`locality.choose_host`).

The multi-host choice from MASTER_ADDR, a wildcard bind and the real two-node job are tested in
network namespaces (tests/distributed/test_two_nodes.py); these cases need no network.
"""

import pytest
from dist_quant.coordinator.locality import Locality, choose_host, here, local_leaders

ONE_HOST = [Locality("boot/netns:1", None)] * 3
TWO_HOSTS = [Locality("boot/netns:1", None), Locality("boot/netns:2", None)]


def test_a_one_host_job_listens_and_advertises_on_loopback():
    bind, advertise, why = choose_host(None, ONE_HOST)
    assert (bind, advertise) == ("127.0.0.1", "127.0.0.1")
    assert "every rank runs on rank 0's host" in why


def test_a_wildcard_bind_on_one_host_advertises_loopback_not_the_wildcard():
    assert choose_host("0.0.0.0", ONE_HOST)[:2] == ("0.0.0.0", "127.0.0.1")


def test_an_explicit_host_is_used_as_given_even_across_hosts():
    assert choose_host("10.1.2.3", TWO_HOSTS)[:2] == ("10.1.2.3", "10.1.2.3")


def test_a_multi_host_job_with_no_routable_address_is_refused_naming_host(monkeypatch):
    for var in ("MASTER_ADDR", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"spans 2 hosts.*pass attach\(\.\.\., host="):
        choose_host(None, TWO_HOSTS)


def test_a_loopback_master_addr_is_not_advertised_to_other_hosts(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR=127.0.0.1 is not a non-loopback address"):
        choose_host(None, TWO_HOSTS)


def test_each_location_has_one_leader_its_lowest_rank():
    locs = [Locality("a", None), Locality("b", None), Locality("a", None), Locality("b", None)]
    assert local_leaders(locs) == {0: "a", 1: "b"}


def test_a_process_reports_one_location_naming_its_network_namespace():
    first, again = here(), here()
    assert first.where == again.where
    assert "/netns:" in first.where or first.where.startswith("host:")
