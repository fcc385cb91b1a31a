"""The `dist-quant` command line: help everywhere, one-line errors with the documented exit codes."""

import json
import subprocess
import sys

import pytest
from dist_quant.launch.cli import CliError, main, parse_recipe_arg

COMMANDS = ["demo", "run", "switch", "cancel", "status", "roles"]


@pytest.mark.parametrize("argv", [[], *([c] for c in COMMANDS)])
def test_help_exits_0_and_shows_usage(argv: list[str], capsys) -> None:
    assert main([*argv, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: dist-quant{' ' + argv[0] if argv else ''}")


def test_top_level_help_lists_every_command(capsys) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], "required"),
        (["train"], "invalid choice"),
        (["demo", "--nproc", "0"], "must be >= 1"),
        (["demo", "--launcher", "mpi"], "invalid choice"),
        (["switch"], "RECIPE"),
        (["switch", "current", "--at-step", "-3"], "must be >= 0"),
        (["switch", "current", "--timeout", "0"], "positive number"),
        (["switch", "current", "--run-dir", "a", "--address", "h:1"], "not allowed with"),
        (["run", "script.py"], "--nproc"),
        (["cancel", "0"], "must be >= 1"),
        (["cancel", "--timeout", "-1"], "positive number"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(argv, match: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err


def test_recipe_argument_forms(tmp_path) -> None:
    assert parse_recipe_arg("current") == "current"
    assert parse_recipe_arg('{"type": "DelayedScaling", "margin": 1}') == {
        "type": "DelayedScaling",
        "margin": 1,
    }
    (tmp_path / "r.json").write_text(json.dumps({"type": "Float8CurrentScaling"}))
    (tmp_path / "r.yaml").write_text("type: DelayedScaling\namax_history_len: 16\n")
    assert parse_recipe_arg(str(tmp_path / "r.json")) == {"type": "Float8CurrentScaling"}
    assert parse_recipe_arg(str(tmp_path / "r.yaml")) == {
        "type": "DelayedScaling",
        "amax_history_len": 16,
    }


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"type": "DelayedScaling",', "not valid JSON"),
        ("[1, 2]", "holds a list"),
        ("missing.yaml", "does not exist"),
        ("   ", "empty"),
    ],
)
def test_unparseable_recipes_are_usage_errors(text: str, match: str) -> None:
    with pytest.raises(CliError, match=match) as info:
        parse_recipe_arg(text)
    assert info.value.code == 2


def test_switch_without_a_job_exits_2_with_one_line(tmp_path, capsys) -> None:
    assert main(["switch", "current", "--run-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "coordinator.json does not exist" in err
    assert main(["status", "--run-dir", str(tmp_path)]) == 2
    assert "coordinator.json does not exist" in capsys.readouterr().err


def test_a_left_over_endpoint_of_a_dead_job_is_one_line_and_exit_2(tmp_path) -> None:
    """coordinator.json left behind (Ctrl-C) points at a closed port: the client says so at once,
    in one line, without the store client's retries and c10d's C++ log."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "coordinator.json").write_text(
        json.dumps({"address": f"127.0.0.1:{port}", "token": "t", "transport": "store"})
    )
    for command in (["switch", "current"], ["status"], ["cancel"]):
        proc = subprocess.run(
            [sys.executable, "-m", "dist_quant.launch.cli", *command, "--run-dir", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1, proc.stderr
        assert f"no coordinator at 127.0.0.1:{port}" in proc.stderr
        assert "the job has ended" in proc.stderr and "coordinator.json" in proc.stderr


@pytest.mark.parametrize(
    "argv", [["--help"], ["switch", "current", "--run-dir", "{d}"], ["status", "--run-dir", "{d}"]]
)
def test_help_and_client_commands_do_not_import_torch(argv, tmp_path) -> None:
    """What makes them start in a fraction of a second: torch is imported only by commands and
    code paths that need it (a store connection to a live job, the demo, roles)."""
    args = [a.replace("{d}", str(tmp_path)) for a in argv]
    code = (
        "import sys\n"
        "from dist_quant.launch.cli import main\n"
        f"rc = main({args!r})\n"
        "print('torch' in sys.modules, rc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.splitlines()[-1] in ("False 0", "False 2"), proc.stdout + proc.stderr


def test_status_of_a_live_job_reaches_it_without_importing_torch(tmp_path) -> None:
    """A coordinator on its TCPStore (as rank 0 runs it); `dist-quant status` in another process
    talks to it with the plain-Python store client."""
    from dist_quant.coordinator.coordinator import Coordinator
    from dist_quant.coordinator.decision_log import DecisionLog
    from dist_quant.coordinator.endpoint import write_endpoint
    from dist_quant.coordinator.transport_store import StoreServer, StoreTransport

    server = StoreServer()
    coord = Coordinator(
        StoreTransport(server.address),
        token="tok",
        world_size=1,
        tp_groups=[(0,)],
        log=DecisionLog(tmp_path / "decisions.jsonl"),
    )
    coord.start()
    write_endpoint(tmp_path, {"address": server.address, "token": "tok", "transport": "store"})
    try:
        code = (
            "import sys\n"
            "from dist_quant.launch.cli import main\n"
            f"rc = main(['status', '--run-dir', {str(tmp_path)!r}])\n"
            "print('torch' in sys.modules, rc)\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
    finally:
        coord.stop()
        server.close()
    lines = proc.stdout.splitlines()
    assert lines[-1] == "False 0", proc.stdout + proc.stderr
    assert lines[0] == "state: idle: no switch requested yet"


def test_switch_with_an_address_but_no_token_exits_2(monkeypatch, capsys) -> None:
    monkeypatch.delenv("DIST_QUANT_TOKEN", raising=False)
    assert main(["switch", "current", "--address", "127.0.0.1:1"]) == 2
    assert "token" in capsys.readouterr().err


def test_installed_command_prints_no_traceback(tmp_path) -> None:
    """The console script's process: exit code 2 and one line on stderr, nothing on stdout."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dist_quant.launch.cli",
            "switch",
            "current",
            "--run-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_demo_refuses_bad_options_before_starting_anything(tmp_path, capsys) -> None:
    assert main(["demo", "--nproc", "2", "--tp", "3", "--out", str(tmp_path)]) == 2
    assert "--tp 3 must divide --nproc 2" in capsys.readouterr().err
    bad = tmp_path / "schedule.yaml"
    bad.write_text("- {step: 0, recipe: bf16}\n- {step: 5, recipe: {type: Bogus}}\n")
    assert main(["demo", "--recipe-schedule", str(bad), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "phase 1: invalid recipe" in err
    assert main(["demo", "--model", "gpt:hidden=30,heads=4", "--out", str(tmp_path)]) == 2
    assert "multiple of heads" in capsys.readouterr().err
    assert not (tmp_path / "ranks").exists()


def test_run_with_a_missing_script_exits_2(tmp_path, capsys) -> None:
    assert main(["run", "--nproc", "2", str(tmp_path / "nope.py")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_switch_sends_a_policy_file_as_the_recipe_the_ranks_build(tmp_path) -> None:
    from dist_quant.launch.cli import parse_recipe_arg

    from dist_quant.policy import policy_of
    from dist_quant.recipes import recipe_from_dict

    path = tmp_path / "p.yaml"
    path.write_text("type: policy\ndefault: current\nrules: [{modules: output, recipe: bf16}]\n")
    payload = parse_recipe_arg(str(path))
    assert payload == {
        "type": "policy",
        "default": "current",
        "rules": [{"modules": "output", "recipe": "bf16"}],
    }
    assert policy_of(recipe_from_dict(payload)).rules[0].name == "rules[0]"


def test_status_names_the_ranks_an_open_switch_waits_for_as_runs() -> None:
    from dist_quant.launch.switch_commands import format_status

    info = {"phase_text": "switch 4: ranks are voting", "waiting_for": [7, 0, 1, 2, 5, 8]}
    lines = format_status(info)
    assert lines[:2] == ["state: switch 4: ranks are voting", "waiting for 6 rank(s): 0-2, 5, 7-8"]
    assert not any(line.startswith("waiting") for line in format_status({"waiting_for": []}))
    # a rank listed twice is one rank of its run, not the end of one run and the start of another
    assert format_status({"waiting_for": [16, 17, 17, 18]})[1] == "waiting for 3 rank(s): 16-18"


def _fake_status(monkeypatch, tp_groups: list[list[int]]) -> str:
    """A status reply of a 2-rank job on current scaling, as the coordinator sends it; returns
    the key repr the ranks reported."""
    from dist_quant.launch import switch_commands

    import dist_quant as dq

    key = repr(dq.recipe_from_dict("current").key())
    info = {
        "phase": "idle",
        "phase_text": "idle: no switch requested yet",
        "world_size": 2,
        "tp_groups": tp_groups,
        "recipe_keys": {"0": key, "1": key},
        "decisions": [],
    }
    monkeypatch.setattr(switch_commands, "query", lambda **kw: dict(info))
    return key


def test_status_json_gives_recipe_keys_in_the_form_the_text_prints(monkeypatch, capsys) -> None:
    import dist_quant as dq

    key = _fake_status(monkeypatch, [[0, 1]])
    short = f"Float8CurrentScaling:{dq.recipe_from_dict('current').digest()[:8]}"
    assert main(["status", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["recipe_keys"] == {"0": short, "1": short}
    assert got["recipe_key_reprs"] == {"0": key, "1": key}
    assert main(["status"]) == 0
    text = capsys.readouterr().out
    assert f"  ranks 0-1: {short}" in text and "ranks: 2, TP groups: [[0, 1]]" in text


def test_status_of_16384_ranks_is_a_line_per_recipe_key_not_per_rank() -> None:
    """Mid-switch on 2,048 nodes: node 1 has published the new recipe, rank 100 has not been
    heard from; the text names each key's ranks as runs and the groups by their shape."""
    from dist_quant.launch.switch_commands import format_status

    import dist_quant as dq

    old, new = (repr(dq.recipe_from_dict(name).key()) for name in ("delayed", "current"))
    keys = {str(r): (new if 8 <= r < 16 else old) for r in range(16384) if r != 100}
    info = {"phase_text": "switch 2: committed for step 40", "world_size": 16384,
            "tp_groups": [list(range(g, g + 8)) for g in range(0, 16384, 8)],
            "recipe_keys": keys, "waiting_for": list(range(16, 16384))}  # fmt: skip
    short_old = f"DelayedScaling:{dq.recipe_from_dict('delayed').digest()[:8]}"
    short_new = f"Float8CurrentScaling:{dq.recipe_from_dict('current').digest()[:8]}"
    assert format_status(info) == [
        "state: switch 2: committed for step 40",
        "waiting for 16368 rank(s): 16-16383",
        "ranks: 16384, 2048 TP groups of 8 consecutive ranks",
        "recipe key per rank:",
        f"  ranks 0-7, 16-99, 101-16383: {short_old}",
        f"  ranks 8-15: {short_new}",
        "  not reported yet: 1 rank(s): 100",
        "last decisions: none yet",
    ]
    uneven = [[0, 1], [2, 3, 4], *([r] for r in range(5, 12))]
    assert "9 TP groups of 1-3 consecutive ranks" in format_status({"tp_groups": uneven})[1]


def test_status_of_a_data_parallel_job_shows_no_tp_groups(monkeypatch, capsys) -> None:
    _fake_status(monkeypatch, [[0], [1]])
    assert main(["status"]) == 0
    text = capsys.readouterr().out
    assert "ranks: 2, no tensor parallelism" in text and "TP groups" not in text


def test_malformed_yaml_recipe_names_its_line_and_column(tmp_path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("type: DelayedScaling\nmargin: [1, 2\namax_history_len: 4\n")
    with pytest.raises(CliError) as info:
        parse_recipe_arg(str(path))
    assert info.value.code == 2
    # the flow sequence opened on line 2 meets the mapping colon of line 3, column 17
    assert str(info.value).endswith("expected ',' or ']', but got ':' at line 3, column 17")


def test_a_switch_waiting_behind_an_open_one_says_it_waits_not_to_retry(monkeypatch, capsys):
    from dist_quant.coordinator.errors import SwitchBusyError
    from dist_quant.coordinator.switch_requests import SwitchResult
    from dist_quant.launch import switch_commands

    replies = [
        SwitchBusyError(
            "switch 3 is still open (committed for step 90); retry after it ends; "
            "`dist-quant cancel 3` cancels it",
            3,
        )
    ]

    def request(*args, **kw):
        if replies:
            raise replies.pop()
        return SwitchResult(switch_id=4, committed=True, step=91, reasons={}, timings={})

    monkeypatch.setattr(switch_commands, "request_switch", request)
    monkeypatch.setattr(switch_commands, "_BUSY_RETRY_S", 0.0)
    assert main(["switch", "current", "--timeout", "5"]) == 0
    err = capsys.readouterr().err
    assert err == (
        "dist-quant: switch 3 is still open (committed for step 90); waiting for it to end "
        "(up to 5 s, Ctrl-C to stop); `dist-quant cancel 3` cancels it\n"
    )


def test_an_aborted_switch_prints_each_ranks_reason_and_exits_1(monkeypatch, capsys):
    from dist_quant.coordinator.switch_requests import SwitchResult
    from dist_quant.launch import switch_commands

    aborted = SwitchResult(
        switch_id=4, committed=False, step=None, reasons={3: "voted no", 1: "no vote"},
        timings={"total_s": 0.25}, summary="rank 1: no vote; rank 3: voted no",
    )  # fmt: skip
    monkeypatch.setattr(switch_commands, "request_switch", lambda *a, **kw: aborted)
    assert main(["switch", "current", "--timeout", "5"]) == 1
    assert capsys.readouterr().out == (
        "switch 4 aborted (decided in 0.250 s); every rank keeps its current recipe:\n"
        "  rank 1: no vote\n  rank 3: voted no\n"
    )


def test_an_abort_naming_thousands_of_ranks_prints_a_line_per_reason(monkeypatch, capsys):
    from dist_quant.coordinator.switch_requests import SwitchResult
    from dist_quant.launch import switch_commands

    silent = "no vote and no sign of life for 1.5 s: dead, stopped or cut off"
    reasons = {r: silent for r in range(4096) if r not in (370, 371)}
    reasons[370] = "ValueError: bad role"
    aborted = SwitchResult(switch_id=2, committed=False, step=None, reasons=reasons,
                           timings={"total_s": 3.0}, summary="node 0-7 ...")  # fmt: skip
    monkeypatch.setattr(switch_commands, "request_switch", lambda *a, **kw: aborted)
    assert main(["switch", "current", "--timeout", "5"]) == 1
    assert capsys.readouterr().out == (
        "switch 2 aborted (decided in 3.000 s); every rank keeps its current recipe:\n"
        f"  ranks 0-369, 372-4095: {silent}\n"
        "  rank 370: ValueError: bad role\n"
    )


def test_a_cancel_refused_without_rank_reasons_prints_the_summary(monkeypatch, capsys):
    from dist_quant.coordinator.results import CancelResult
    from dist_quant.launch import switch_commands

    kept = CancelResult(4, False, 90, {}, "not cancelled: the cancel was logged after its deadline")
    monkeypatch.setattr(switch_commands, "cancel_switch", lambda *a, **kw: kept)
    assert main(["cancel", "4", "--timeout", "5"]) == 1
    assert capsys.readouterr().out == (
        "switch 4 not cancelled; every rank switches at step 90:\n"
        "  not cancelled: the cancel was logged after its deadline\n"
    )
