"""`outboxctl`: the command line of the outbox sidecar.

Subcommands are added by the parts that own them (migrations, relay, checker, reconciliation).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib.metadata import version


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outboxctl", description="Kafka transactional outbox sidecar: run and inspect it."
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {version('kafka-outbox-sidecar')}"
    )
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
