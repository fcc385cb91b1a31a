"""Run a command on this machine as if its DNS resolver were slow or dropped queries.

    python bench/slow_resolver.py [--delay-ms 200] [--drop-every K] -- COMMAND ...
    python bench/slow_resolver.py [--delay-ms 200] [--drop-every K] --connects 256

No LD_PRELOAD and no change to the machine: the script re-runs itself under
`unshare --user --mount --net` (a private network namespace with only loopback, a private mount
table), bind-mounts a resolv.conf there that names 127.0.0.1 as the only nameserver, and answers
every query on 127.0.0.1:53 itself: NXDOMAIN after `--delay-ms`, except every K-th query, which
it drops (`--drop-every K`), so the C library waits out its timeout (5 s) and asks again: what a
loaded resolver did on the machine this was written on (one query in ~50 lost). Everything inside the namespace (both ends of every
connection are on loopback) sees that resolver; nothing outside does. At exit it prints how many
queries it got, which names which code asked the resolver at all.

`--map-hosts` also bind-mounts an /etc/hosts with the line `::ffff:127.0.0.1 localhost`: the
resolver setting docs/reliability.md recommends (torch's client asks for the name of its own
socket's address in its IPv4-mapped IPv6 form, which a hosts file's IPv4 lines do not match).

`--connects N` measures the connects themselves: N store connections to a fresh server, 32 at a
time, with torch's TCPStore client and with dist-quant's plain client (how ranks connect), each
within attach's 5 s deadline; it prints time and failures per client.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

_INSIDE = "DQ_SLOW_RESOLVER_INSIDE"


class Resolver:
    """A DNS server on 127.0.0.1:53 that answers NXDOMAIN after a delay, dropping every
    `drop_every`-th query (0: none)."""

    def __init__(self, delay_s: float, drop_every: int) -> None:
        self.delay_s, self.drop_every = delay_s, drop_every
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 53))
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            query, peer = self._sock.recvfrom(4096)
            self.queries += 1
            if not (self.drop_every and self.queries % self.drop_every == 0):
                reply = _nxdomain(query)
                threading.Timer(self.delay_s, self._sock.sendto, (reply, peer)).start()


def _nxdomain(query: bytes) -> bytes:
    """The query's header and question back, flagged a response with "no such name"."""
    end = 12
    while query[end]:
        end += query[end] + 1
    end += 5  # the root label, then type and class
    return query[:2] + b"\x81\x83" + b"\x00\x01" + b"\x00" * 6 + query[12:end]


def _connects(n: int) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from dist_quant.coordinator.transport_store import StoreServer
    from dist_quant.coordinator.transport_store_client import StoreClientTransport

    server = StoreServer()
    host, port = "127.0.0.1", server.port
    clients = {
        "torch TCPStore client": lambda: dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=5)
        ),
        "plain client (ranks)": lambda: StoreClientTransport(server.address, connect_timeout_s=5),
    }
    kept = []
    for name, connect in clients.items():

        def one(_: int, connect=connect) -> float | None:
            t0 = time.monotonic()
            try:
                kept.append(connect())
            except Exception:  # noqa: BLE001 - counted as a failed attach
                return None
            took = time.monotonic() - t0
            return took if took <= 5.0 else None  # attach's deadline

        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            times = list(pool.map(one, range(n)))
        ok = [t for t in times if t is not None]
        print(
            f"{name:<22}: {n} connects in {time.monotonic() - t0:6.1f} s, "
            f"{n - len(ok)} failed or past 5 s, slowest {max(ok, default=0):.2f} s",
            flush=True,
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=200.0)
    parser.add_argument("--drop-every", type=int, default=0, help="drop one query in K")
    parser.add_argument("--map-hosts", action="store_true")
    parser.add_argument("--connects", type=int, default=0)
    parser.add_argument("command", nargs="*")
    args = parser.parse_args()
    if not args.command and not args.connects:
        parser.error("give a command after --, or --connects N")
    if os.environ.get(_INSIDE) != "1":
        env = {**os.environ, _INSIDE: "1"}
        argv = ["unshare", "--user", "--map-root-user", "--mount", "--net", "--",
                sys.executable, *sys.argv]  # fmt: skip
        return subprocess.run(argv, env=env).returncode
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".resolv.conf", delete=False) as conf:
        conf.write("nameserver 127.0.0.1\n")
    subprocess.run(["mount", "--bind", conf.name, "/etc/resolv.conf"], check=True)
    made = [conf.name]
    if args.map_hosts:
        with tempfile.NamedTemporaryFile("w", suffix=".hosts", delete=False) as hosts:
            hosts.write(open("/etc/hosts").read() + "\n::ffff:127.0.0.1 localhost\n")
        subprocess.run(["mount", "--bind", hosts.name, "/etc/hosts"], check=True)
        made.append(hosts.name)
    resolver = Resolver(args.delay_ms / 1e3, args.drop_every)
    what = f"answering after {args.delay_ms:g} ms"
    if args.drop_every:
        what += f", dropping one query in {args.drop_every}"
    print(f"resolver on 127.0.0.1:53, {what}", flush=True)
    rc = 0
    if args.connects:
        _connects(args.connects)
    if args.command:
        rc = subprocess.run(args.command).returncode
    print(f"resolver got {resolver.queries} queries", flush=True)
    for path in made:
        os.unlink(path)
    return rc


if __name__ == "__main__":
    sys.exit(main())
