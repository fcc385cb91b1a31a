"""The `dist-quant` command line."""

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dist-quant", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the demo training job (CPU by default)")
    demo.add_argument("--nproc", type=int, default=2)
    demo.add_argument("--steps", type=int, default=60)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        print(
            f"dist-quant demo: will train a small GPT on {args.nproc} ranks for {args.steps} steps, "
            "switching recipes mid-run through the coordinator (not built yet)."
        )
    return 0
