"""The `dist-quant` command line: demo, run, switch, cancel, status, roles, stats.

Nothing heavy is imported before the arguments are parsed: `--help`, `switch`, `cancel`, `status`
and `stats` never import torch; the `demo` and `roles` handlers import what needs it when they run.

Every error is one line on stderr and an exit code, never a traceback (set DIST_QUANT_DEBUG=1 to
get the traceback of an unexpected error). Exit codes:

    0  success (`switch`: the switch committed on every rank; `cancel`: cancelled on every rank)
    1  the job answered no: `switch` aborted (each rank's reason is printed) or was refused
       because another switch stayed open; `cancel` refused or too late; `demo` failed;
       `roles`: the recipe does not fit the model
    2  usage errors (bad flags, unparseable recipe JSON/YAML, bad model spec) and connection
       errors (no job in the run directory, coordinator unreachable, wrong token)
  128+N  `run` and `demo` stopped by signal N (130: Ctrl-C, 143: SIGTERM), every rank stopped

A recipe that parses but is not a valid recipe (unknown type or field, bad value) is sent to the
job like any other: every rank votes no with the reason, `switch` exits 1 and training goes on
unchanged.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from dist_quant.launch.errors import CliError
from dist_quant.launch.stats import add_stats_parser, run_stats
from dist_quant.launch.stop_signals import StopRequested, stop_on_signals
from dist_quant.launch.switch_commands import cancel, status, switch
from dist_quant.launch.torchrun import run_script

from dist_quant.recipe_files import read_recipe_spec


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse prints usage plus the error and exits; we want one line and exit code 2.
        raise CliError(f"{self.prog}: {message} (see '{self.prog} --help')", 2)


def parse_recipe_arg(text: str) -> str | dict[str, Any]:
    """RECIPE as given on the command line -> the payload the coordinator sends to ranks
    (`recipe_files.read_recipe_spec`: inline JSON, a JSON/YAML file, or a built-in name).
    Unparseable input raises CliError (exit 2); whether the recipe itself is valid is for the
    ranks (or `roles`) to say."""
    try:
        return read_recipe_spec(text)
    except ValueError as e:
        raise CliError(f"RECIPE: {e}", 2) from e


def _int_at_least(minimum: int):
    """An argparse type: an integer >= minimum."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _add_target(p: argparse.ArgumentParser) -> None:
    """How a client finds a job: its run directory, or an address plus token."""
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--run-dir",
        metavar="DIR",
        help="the job's run directory (holds coordinator.json); default $DIST_QUANT_RUN_DIR, "
        "else ./dist_quant_run",
    )
    where.add_argument("--address", metavar="HOST:PORT", help="the coordinator's address")
    p.add_argument("--token", help="the job's token, with --address (default $DIST_QUANT_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="dist-quant",
        description="FP8 training for PyTorch with atomic cluster-wide recipe switches.",
        epilog="Exit codes: 0 success, 1 the job answered no (switch aborted or refused), "
        "2 usage or connection error.",
    )
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=_Parser
    )

    demo = sub.add_parser(
        "demo",
        help="train a small GPT on N ranks, switching recipes mid-run through the coordinator",
        description="Train a small GPT (dist-quant TransformerLayers, tensor parallel) on a "
        "synthetic language, switching recipes mid-run through the coordinator: bf16 warm-up, "
        "FP8 delayed scaling, FP8 current scaling, bf16 tail. CPU (gloo) by default; NCCL on GPUs.",
    )
    demo.add_argument("--nproc", type=_positive_int, default=2, help="ranks (default 2)")
    demo.add_argument(
        "--tp",
        type=_positive_int,
        default=None,
        help="tensor-parallel size; must divide --nproc (default 2 for an even --nproc, else 1)",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=200, help="optimizer steps (default 200)"
    )
    demo.add_argument(
        "--launcher",
        choices=("torchrun", "ray", "ray-train"),
        default="torchrun",
        help="torchrun (default): local processes; ray: Ray actors, joining a running cluster "
        "or starting a local one; ray-train: the ranks as a Ray Train TorchTrainer's workers "
        '(needs Ray: pip install -e ".[ray]", or ".[ray-train]" for ray-train)',
    )
    demo.add_argument(
        "--recipe-schedule",
        metavar="FILE",
        help="YAML/JSON list of phases {step|fraction, recipe, label}; "
        "default: bf16 0%%, delayed 25%%, current 55%%, bf16 85%%",
    )
    demo.add_argument(
        "--out",
        metavar="DIR",
        default="dist_quant_run",
        help="run directory: coordinator.json, logs, summary, loss.png "
        "(default ./dist_quant_run, where 'dist-quant switch' looks by default)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the weights and of the synthetic language (default 0): equal seeds, "
        "equal runs",
    )
    demo.add_argument(
        "--model",
        metavar="SPEC",
        default="gpt",
        help="model spec, see 'dist-quant roles --help' (default gpt)",
    )
    demo.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA + NCCL when every rank can have a GPU, else CPU + gloo",
    )
    demo.add_argument(
        "--step-delay",
        type=float,
        default=0.0,
        metavar="S",
        help="sleep S seconds after each step, to watch the demo or to try "
        "'dist-quant switch' from another terminal",
    )
    demo.add_argument("--guard", action="store_true", help="run the precision guard (FP8 stats)")
    demo.add_argument(
        "--spike-at", type=_non_negative_int, metavar="STEP", help="inject an outlier"
    )

    run = sub.add_parser(
        "run",
        help="run a training script on N local ranks with torchrun",
        description="python -m torch.distributed.run --standalone --nproc-per-node N SCRIPT ARGS, "
        "with DIST_QUANT_RUN_DIR exported so attach() and 'dist-quant switch' meet.",
    )
    run.add_argument("--nproc", type=_positive_int, required=True, help="ranks on this machine")
    run.add_argument("--run-dir", metavar="DIR", help="exported as DIST_QUANT_RUN_DIR")
    run.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name")
    run.add_argument("script", metavar="SCRIPT")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS")

    switch = sub.add_parser(
        "switch",
        help="switch a running job to RECIPE on every rank at once",
        description="Ask a running job's coordinator to switch every rank to RECIPE at the same "
        "step. RECIPE: a built-in name (delayed, current, mxfp8, block, nvfp4, bf16), a JSON object, or "
        "a JSON/YAML file. Exit 0: committed; 1: aborted (each rank's reason is printed) or "
        "refused (another switch is open); 2: usage or connection error, unparseable RECIPE.",
    )
    switch.add_argument("recipe", metavar="RECIPE")
    switch.add_argument(
        "--at-step",
        type=_non_negative_int,
        default=None,
        help="commit at this step (default: the step after every rank has voted)",
    )
    switch.add_argument(
        "--timeout",
        type=_positive_float,
        default=60.0,
        metavar="S",
        help="give up (abort) if not decided within S seconds (default 60); also how long to "
        "wait for a switch that is already open",
    )
    switch.add_argument(
        "--no-wait",
        action="store_true",
        help="exit 1 at once if another switch is open, instead of waiting for it to close",
    )
    _add_target(switch)

    cancel = sub.add_parser(
        "cancel",
        help="cancel a switch that committed for a later step, on every rank at once",
        description="Cancel the open switch (or SWITCH_ID) that committed for a later step "
        "(`switch --at-step N`). Every rank votes; if none has reached the step, the cancel is "
        "logged and every rank keeps its current recipe, else the switch happens as committed. "
        "Exit 0: cancelled; 1: refused (nothing to cancel) or too late; 2: connection error.",
    )
    cancel.add_argument(
        "switch_id",
        metavar="SWITCH_ID",
        nargs="?",
        type=_positive_int,
        default=None,
        help="the switch to cancel (default: the open one)",
    )
    cancel.add_argument(
        "--timeout",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="give up (keep the commit) if the ranks have not all answered within S seconds "
        "(default 10)",
    )
    _add_target(cancel)

    status = sub.add_parser(
        "status",
        help="show a running job's recipe per rank, open switch and last decisions",
        description="Query a running job's coordinator: each rank's recipe key, the open switch "
        "(if any), and the last decisions. Exit 2 if the job cannot be reached.",
    )
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    _add_target(status)

    roles = sub.add_parser(
        "roles",
        help="print every quantizer role a model emits and the quantizer a recipe gives it",
        description="Print the role table of a model: module, slot, role, and the quantizer "
        "class the recipe gives it. MODEL_SPEC is 'gpt' with optional comma-separated "
        "key=value overrides (gpt:layers=2,hidden=64,heads=4,ffn=256,vocab=64,seq=32), or "
        "'pkg.module:function' naming a function that takes no arguments and returns the model.",
    )
    roles.add_argument("model_spec", metavar="MODEL_SPEC")
    roles.add_argument(
        "--recipe",
        metavar="RECIPE",
        default=None,
        help="built-in name, JSON object or file (default: autocast's default "
        "recipe on this machine)",
    )
    add_stats_parser(sub)
    return parser


# ---- handlers --------------------------------------------------------------------------------
def _cmd_demo(args: argparse.Namespace) -> int:
    with stop_on_signals():  # before torch's import: a stop from now on stops the job cleanly
        return _run_demo(args)


def _run_demo(args: argparse.Namespace) -> int:
    from dist_quant.launch.demo import DemoOptions, run_demo  # torch: only `demo` needs it

    return run_demo(
        DemoOptions(
            nproc=args.nproc,
            tp=args.tp,
            steps=args.steps,
            launcher=args.launcher,
            schedule_file=args.recipe_schedule,
            out=args.out,
            seed=args.seed,
            model=args.model,
            device=args.device,
            step_delay=args.step_delay,
            guard=args.guard,
            spike_at=args.spike_at,
        )
    )


def _cmd_run(args: argparse.Namespace) -> int:
    try:
        with stop_on_signals():
            rc = run_script(
                args.nproc,
                args.script,
                args.args,
                module=args.module,
                run_dir=args.run_dir,
                announce=sys.stderr,
            )
    except FileNotFoundError as e:
        raise CliError(str(e), 2) from e
    if rc != 0:
        raise CliError(f"{args.script} failed on at least one rank (torchrun exit code {rc})", 1)
    return 0


def _quiet_c10d() -> None:
    """A client's store connection must not print c10d's C++ warnings and backtraces (read by
    torch when it is imported, which happens only once a job is found)."""
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


def _cmd_switch(args: argparse.Namespace) -> int:
    _quiet_c10d()
    return switch(
        parse_recipe_arg(args.recipe),
        at_step=args.at_step,
        timeout_s=args.timeout,
        run_dir=args.run_dir,
        address=args.address,
        token=args.token,
        wait=not args.no_wait,
    )


def _cmd_cancel(args: argparse.Namespace) -> int:
    _quiet_c10d()
    return cancel(
        args.switch_id,
        timeout_s=args.timeout,
        run_dir=args.run_dir,
        address=args.address,
        token=args.token,
    )


def _cmd_status(args: argparse.Namespace) -> int:
    _quiet_c10d()
    return status(run_dir=args.run_dir, address=args.address, token=args.token, as_json=args.json)


def _cmd_roles(args: argparse.Namespace) -> int:
    from dist_quant.launch.roles import print_role_table  # torch: only `roles` needs it

    recipe = None if args.recipe is None else parse_recipe_arg(args.recipe)
    return print_role_table(args.model_spec, recipe)


_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo": _cmd_demo,
    "run": _cmd_run,
    "switch": _cmd_switch,
    "cancel": _cmd_cancel,
    "status": _cmd_status,
    "roles": _cmd_roles,
    "stats": run_stats,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `dist-quant`; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        return _COMMANDS[args.command](args)
    except CliError as e:
        print(
            f"dist-quant: {e}" if not str(e).startswith("dist-quant") else str(e), file=sys.stderr
        )
        return e.code
    except SystemExit as e:  # --help, or a handler that exits on purpose
        return e.code if isinstance(e.code, int) else 0
    except KeyboardInterrupt:
        print("dist-quant: interrupted", file=sys.stderr)
        return 130
    except StopRequested as e:  # `run` and `demo` have stopped every rank by now
        print(f"dist-quant: {e}; every rank has stopped", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if os.environ.get("DIST_QUANT_DEBUG"):
            raise
        first = (str(e).strip().splitlines() or [""])[0]
        print(f"dist-quant: {type(e).__name__}: {first}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: the handlers raise the CliError of
    # `dist_quant.launch.cli`, which a second copy of the class would not catch.
    from dist_quant.launch.cli import main as _main

    sys.exit(_main())
