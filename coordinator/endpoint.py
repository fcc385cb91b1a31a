"""Where a job's coordinator can be found: `<run_dir>/coordinator.json` (mode 0600).

run_dir is the argument, else `$DIST_QUANT_RUN_DIR`, else `./dist_quant_run`. The file holds the
address, the per-job token and the transport; the decision log sits beside it.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

ENDPOINT_FILE = "coordinator.json"
LOG_FILE = "decisions.jsonl"


def resolve_run_dir(run_dir: str | os.PathLike[str] | None) -> Path:
    chosen = run_dir or os.environ.get("DIST_QUANT_RUN_DIR") or "dist_quant_run"
    return Path(chosen).absolute()


def write_endpoint(run_dir: Path, info: dict[str, Any]) -> Path:
    """Write the endpoint atomically, readable by the owner only (it holds the token)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ENDPOINT_FILE
    # host and pid: nodes sharing one run dir (NFS) each write the same content
    tmp = run_dir / f".{ENDPOINT_FILE}.{socket.gethostname()}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode does not apply to a leftover file
        os.write(fd, json.dumps(info, indent=1, sort_keys=True).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    return path


def read_endpoint(run_dir: Path) -> dict[str, Any]:
    """The endpoint of the job in `run_dir`; raises FileNotFoundError or ValueError naming it."""
    path = run_dir / ENDPOINT_FILE
    text = path.read_text(encoding="utf-8")
    try:
        info = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(info, dict) or not isinstance(info.get("token"), str):
        raise ValueError(f"{path} lacks a 'token' string")
    if not isinstance(info.get("address"), str):
        raise ValueError(f"{path} lacks an 'address' string")
    return info


def remove_endpoint(run_dir: Path, token: str) -> None:
    """Remove the endpoint file at shutdown, unless another job has replaced it since."""
    try:
        if read_endpoint(run_dir)["token"] == token:
            (run_dir / ENDPOINT_FILE).unlink()
    except (OSError, ValueError):
        pass  # already gone or replaced: nothing of ours to remove


def parse_address(address: str) -> tuple[str, int]:
    """ "host:port" or "[v6]:port" -> (host, port); raises ValueError naming the address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"coordinator address {address!r} is not of the form host:port")
    return host.strip("[]"), int(port)
