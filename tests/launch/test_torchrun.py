"""`dist-quant run`: torchrun on N local ranks, exit codes passed on, and no rank left behind."""

import os
import signal
import sys
import time
from pathlib import Path

from dist_quant.launch import torchrun
from dist_quant.launch.cli import main
from dist_quant.launch.torchrun import TorchrunJob, torchrun_command

SCRIPT = """
import os, sys, time
import torch, torch.distributed as dist
out = sys.argv[1]
mode = sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
with open(os.path.join(out, f"pid{rank}"), "w") as f:
    f.write(str(os.getpid()))
if mode == "fail" and rank == 1:
    sys.exit(3)
if mode == "hang":
    time.sleep(600)
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
with open(os.path.join(out, f"rank{rank}"), "w") as f:
    f.write(f"{t.item()} {dist.get_world_size()} {os.environ['DIST_QUANT_RUN_DIR']}")
dist.destroy_process_group()
"""


def test_command_is_torch_distributed_run_standalone() -> None:
    """The child is torch's torchrun main behind a `__main__` that only quiets its stop."""
    argv = torchrun_command(4, ["train.py", "--lr", "1"])
    assert argv[:3] == [sys.executable, "-m", "dist_quant.launch.torchrun"]
    source = Path(torchrun.__file__).read_text()
    assert "from torch.distributed.run import main as _torchrun_main" in source
    assert argv[3:] == [
        "--standalone",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "4",
        "train.py",
        "--lr",
        "1",
    ]
    assert torchrun_command(2, ["pkg.mod"], module=True)[-2:] == ["-m", "pkg.mod"]


def test_run_starts_n_ranks_with_the_run_dir_exported(tmp_path, capsys) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "job"
    assert (
        main(["run", "--nproc", "2", "--run-dir", str(run_dir), str(script), str(tmp_path), "ok"])
        == 0
    )
    for rank in range(2):
        total, world, seen_dir = (tmp_path / f"rank{rank}").read_text().split(" ")
        assert float(total) == 1.0 + 2.0 and world == "2"
        assert seen_dir == str(run_dir.resolve())


def test_a_failing_rank_makes_run_exit_1_with_one_line(tmp_path, capsys) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    assert main(["run", "--nproc", "2", str(script), str(tmp_path), "fail"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dist-quant: ") and "torchrun exit code" in err[-1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_stop_leaves_no_rank_running(tmp_path) -> None:
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    with open(tmp_path / "log", "w") as log:
        job = TorchrunJob(2, [str(script), str(tmp_path), "hang"], stdout=log).start()
        try:
            deadline = time.monotonic() + 120
            while not all((tmp_path / f"pid{r}").exists() for r in range(2)):
                assert job.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            time.sleep(0.2)  # the pid files are written; the ranks now sleep
            pids = [int((tmp_path / f"pid{r}").read_text()) for r in range(2)]
            assert all(_alive(p) for p in pids)
            rc = job.stop(grace_s=10)
        finally:
            job.stop(grace_s=0)
    assert rc != 0
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [p for p in pids if _alive(p)]
    for p in leftover:  # never leave them behind, even when the test fails
        os.kill(p, signal.SIGKILL)
    assert leftover == []


KILLED_AFTER_ATTACH = """
import os, signal, sys
from pathlib import Path
from dist_quant.coordinator.endpoint import write_endpoint
if os.environ["RANK"] == "0":  # as attach() does on rank 0
    write_endpoint(Path(sys.argv[1]), {"address": "127.0.0.1:1", "token": "this-job"})
os.kill(os.getpid(), signal.SIGKILL)  # stopped by a signal: no atexit, the file stays behind
"""


def test_run_removes_the_endpoint_its_job_left_behind(tmp_path, capsys) -> None:
    script = tmp_path / "script.py"
    script.write_text(KILLED_AFTER_ATTACH)
    run_dir = tmp_path / "job"
    argv = ["run", "--nproc", "1", "--run-dir", str(run_dir), str(script), str(run_dir)]
    assert main(argv) == 1
    assert not (run_dir / "coordinator.json").exists()


def test_run_leaves_an_endpoint_it_did_not_write(tmp_path, capsys) -> None:
    """Another job's coordinator.json in the run dir (unchanged by this run) is not this run's to
    remove."""
    from pathlib import Path

    from dist_quant.coordinator.endpoint import write_endpoint

    run_dir = tmp_path / "job"
    write_endpoint(Path(run_dir), {"address": "127.0.0.1:2", "token": "other-job"})
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    assert (
        main(["run", "--nproc", "2", "--run-dir", str(run_dir), str(script), str(tmp_path), "ok"])
        == 0
    )
    assert '"other-job"' in (run_dir / "coordinator.json").read_text()
