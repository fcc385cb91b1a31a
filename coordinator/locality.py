"""Where a rank runs, and which address of rank 0 the other ranks reach.

Two ranks share a loopback interface exactly when they run on the same kernel in the same network
namespace, so a rank's location is (boot id, network-namespace inode), with the host name as the
fallback where /proc has neither. `attach` gathers every rank's `Locality` in its first collective:
one location means the coordinator stays on 127.0.0.1; several mean rank 0 must listen where the
others reach it, which `routable_host` finds, in this order:

1. `MASTER_ADDR`, when it is an address of rank 0's host (torchrun and most launchers set it to the
   address every rank already reached for the rendezvous);
2. the IPv4 address of `GLOO_SOCKET_IFNAME` / `NCCL_SOCKET_IFNAME` (the interface the process group
   uses);
3. the local address the kernel routes to another rank's reported address through.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

WILDCARDS = ("0.0.0.0", "::", "")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class Locality:
    """One rank's location (`where`) and the address it believes others reach it at (`reach`)."""

    where: str
    reach: str | None


def here() -> Locality:
    """This process's location and reachable address (no packet is sent)."""
    return Locality(_where(), _reach_address())


def spans_hosts(localities: Sequence[Locality]) -> bool:
    return len({loc.where for loc in localities}) > 1


def local_leaders(localities: Sequence[Locality]) -> dict[int, str]:
    """The lowest rank of each location -> that location: the ranks that write coordinator.json."""
    leaders: dict[str, int] = {}
    for rank, loc in enumerate(localities):
        leaders.setdefault(loc.where, rank)
    return {rank: where for where, rank in leaders.items()}


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def choose_host(host: str | None, localities: Sequence[Locality]) -> tuple[str, str, str]:
    """(bind, advertise, why) for rank 0's coordinator store, given every rank's locality (rank 0
    first): loopback for a one-host job, else the address the other ranks reach rank 0 at. An
    explicit `host` is used as given; a wildcard `host` binds every interface and advertises what
    the default would."""
    if host is not None and not is_wildcard(host):
        return host, host, f"host={host} was passed to attach"
    if not spans_hosts(localities):
        return host or "127.0.0.1", "127.0.0.1", "every rank runs on rank 0's host"
    others = [loc for loc in localities if loc.where != localities[0].where]
    try:
        advertise, found = routable_host(others)
    except ValueError as e:
        raise ValueError(
            f"the job spans {len({loc.where for loc in localities})} hosts, and no address of "
            f"rank 0's host that the others reach was found ({e}); pass attach(..., host=<rank 0's "
            "address on the network the ranks share>)"
        ) from None
    return host or advertise, advertise, f"the job spans hosts and {found} names it"


def routable_host(peers: Sequence[Locality]) -> tuple[str, str]:
    """(address, how it was found) of this host that the ranks in `peers` reach; raises ValueError
    naming what was tried when there is none."""
    tried = []
    master = os.environ.get("MASTER_ADDR")
    if master:
        addr = _resolve(master)
        if addr is not None and not _is_loopback(addr) and _bindable(addr):
            return addr, f"MASTER_ADDR={master}"
        tried.append(f"MASTER_ADDR={master} is not a non-loopback address of this host")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        ifname = (os.environ.get(var) or "").split(",")[0].strip()
        if ifname:
            addr = interface_address(ifname)
            if addr is not None and not _is_loopback(addr):
                return addr, f"{var}={ifname}"
            tried.append(f"{var}={ifname} has no IPv4 address here")
    for peer in peers:
        if peer.reach:
            addr = _source_address_to(peer.reach)
            if addr is not None and not _is_loopback(addr):
                return addr, f"the route to {peer.reach}"
    tried.append("no other rank reported an address to route to")
    raise ValueError("; ".join(tried))


def interface_address(ifname: str) -> str | None:
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(
                s.fileno(), _SIOCGIFADDR, struct.pack("256s", ifname[:15].encode())
            )
        return socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError):
        return None


def _where() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        netns = os.stat("/proc/self/ns/net").st_ino
        return f"{boot}/netns:{netns}"
    except OSError:
        return f"host:{socket.gethostname()}"


def _reach_address() -> str | None:
    """The address the process group most likely reaches this rank at."""
    master = os.environ.get("MASTER_ADDR")
    if master:
        addr = _resolve(master)
        if addr is not None and not _is_loopback(addr):
            return _source_address_to(addr)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        ifname = (os.environ.get(var) or "").split(",")[0].strip()
        if ifname:
            return interface_address(ifname)
    addr = _resolve(socket.gethostname())
    return None if addr is None or _is_loopback(addr) else addr


def _resolve(name: str) -> str | None:
    try:
        return socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _bindable(addr: str) -> bool:
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def _source_address_to(addr: str) -> str | None:
    """The local address the kernel would send from to reach `addr` (a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))
            return s.getsockname()[0]
    except OSError:
        return None
