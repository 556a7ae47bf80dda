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
    agent = commands.add_parser(
        "agent", help="the per-node daemon: serves the probes, spools, forwards, /metrics"
    )
    agent.add_argument("--socket", help="probe socket (default $TORSHMON_AGENT_SOCKET)")
    agent.add_argument("--metrics-host", default=None, help="/metrics address (127.0.0.1)")
    agent.add_argument("--metrics-port", type=_port, default=None, help="/metrics port (9465)")
    agent.add_argument(
        "--aggregator", help="aggregator base URL, e.g. http://host:9470 ($TORSHMON_AGGREGATOR_URL)"
    )
    agent.add_argument("--token-file", type=Path, help="file holding the bearer token")
    agent.add_argument("--spool", help="spool file ($TORSHMON_AGENT_SPOOL)")
    agent.add_argument("--spool-max-mb", type=_positive_int, help="spool bound in MiB (256)")
    agent.add_argument("--node", help="node name (the hostname)")
    agent.add_argument("--agent-id", help="agent id (the node name)")
    agent.add_argument("--sample-interval-s", type=float, help="node sampling interval (2)")
    return parser


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 0..65535, got {value}")
    return value


def _run_agent(args: argparse.Namespace) -> int:
    import asyncio

    from torshmon.agent.daemon import run_agent, settings_from_env

    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            print(f"torshmon agent: cannot read --token-file: {exc}", file=sys.stderr)
            return 2
    try:
        settings = settings_from_env(
            socket_path=args.socket,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            aggregator_url=args.aggregator,
            token=token,
            spool_path=args.spool,
            spool_max_bytes=args.spool_max_mb * 1024 * 1024 if args.spool_max_mb else None,
            node=args.node,
            agent_id=args.agent_id,
            sample_interval_s=args.sample_interval_s,
        )
    except ValueError as exc:
        print(f"torshmon agent: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(run_agent(settings))
    except OSError as exc:
        print(f"torshmon agent: cannot start: {exc}", file=sys.stderr)
        return 1


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
    if args.command == "agent":
        return _run_agent(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse enforces the choices


if __name__ == "__main__":
    sys.exit(main())
