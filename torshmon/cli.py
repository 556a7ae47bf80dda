"""The ``torshmon`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torshmon", description="Monitor and tune distributed PyTorch training."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser(
        "demo", help="run a real multi-process gloo DDP job with the probe attached"
    )
    demo.add_argument("--world-size", type=_positive_int, default=2, help="ranks (default 2)")
    demo.add_argument("--steps", type=_positive_int, default=200, help="steps (default 200)")
    demo.add_argument("--hidden", type=_positive_int, default=1024, help="MLP width (default 1024)")
    demo.add_argument("--layers", type=_positive_int, default=4, help="MLP depth (default 4)")
    demo.add_argument("--batch-size", type=_positive_int, default=64, help="per rank (default 64)")
    demo.add_argument("--job", default="demo", help="job name (default 'demo')")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("torshmon-demo.jsonl"),
        help="where the received records go (default ./torshmon-demo.jsonl)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command == "demo":
        from torshmon.demo import DemoConfig, run_demo

        config = DemoConfig(
            world_size=args.world_size,
            steps=args.steps,
            hidden=args.hidden,
            layers=args.layers,
            batch_size=args.batch_size,
            job=args.job,
            out=args.out,
        )
        return run_demo(config)
    raise AssertionError(f"unhandled command {args.command}")  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
