"""Two "hosts" on one machine: two network namespaces joined by a veth pair (10.77.0.1/24 and
10.77.0.2/24). Each namespace has its own loopback, so 127.0.0.1 of one is not the other's: what a
coordinator bound to loopback looks like from another node. Traffic stays inside the two
namespaces (no route to anywhere else).

`two_hosts()` is a context manager: it yields a `Hosts`, and kills every process started through `Hosts.popen`
and every process left inside the namespaces, then removes the namespaces (and so the veth pair) on exit, even when
the test fails. `skip_reason()` says why namespaces cannot be made here (not root, no `ip`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

ADDRESSES = ("10.77.0.1", "10.77.0.2")


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


def skip_reason() -> str | None:
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"dqprobe{os.getpid()}"
    made = _ip("netns", "add", probe)
    if made.returncode != 0:
        return f"`ip netns add` is refused here: {made.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    namespaces: tuple[str, str]
    interfaces: tuple[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def env(self, node: int, **extra: str) -> dict[str, str]:
        """The environment of a process on `node`: gloo on that node's veth interface."""
        return {**os.environ, "GLOO_SOCKET_IFNAME": self.interfaces[node], **extra}

    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[node], *argv]

    def popen(self, node: int, argv: Sequence[str], env: dict[str, str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(
            self.command(node, argv), env=env, start_new_session=True, **kw
        )  # its own process group: killed as a whole on exit
        self.procs.append(proc)
        return proc

    def run(self, node: int, argv: Sequence[str], env: dict[str, str], timeout: float):
        return subprocess.run(
            self.command(node, argv), env=env, capture_output=True, text=True, timeout=timeout
        )


def _must(*args: str) -> None:
    done = _ip(*args)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    tag = str(os.getpid())
    names = (f"dqn{tag}a", f"dqn{tag}b")
    ifaces = (f"dqv{tag}a", f"dqv{tag}b")
    hosts = Hosts(names, ifaces)
    try:
        for ns in names:
            _must("netns", "add", ns)
        _must("link", "add", ifaces[0], "type", "veth", "peer", "name", ifaces[1])
        for ns, iface, addr in zip(names, ifaces, ADDRESSES):
            _must("link", "set", iface, "netns", ns)
            _must("-n", ns, "addr", "add", f"{addr}/24", "dev", iface)
            _must("-n", ns, "link", "set", iface, "up")
            _must("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for proc in hosts.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        for ns in names:  # torchrun starts its workers in sessions of their own
            for pid in _ip("netns", "pids", ns).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for ns in names:
            _ip("netns", "del", ns)  # also removes the veth end inside it
