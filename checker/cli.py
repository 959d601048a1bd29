"""`outboxctl` subcommands of the checker (filled in by the checker issue)."""

from __future__ import annotations

import argparse
from typing import Any


def add_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register the checker's subcommands on outboxctl's subparsers."""
