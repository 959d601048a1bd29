"""The soak's own Postgres and Kafka, through `scripts/services.py` with the soak's environment:
its ports and its `.local/soak`, never the developer's stack."""

from __future__ import annotations

import subprocess
import sys

from scripts.soak.settings import SERVICES, Settings

TIMEOUT_S = 300  # a first `up` resolves the broker's jars and formats its storage


def services(settings: Settings, *args: str) -> str:
    """Run `scripts/services.py ARGS` on the soak's stack; what it said, in a line (without the
    environment lines `up` prints). Raises with all of its output if it fails."""
    result = subprocess.run(
        [sys.executable, str(SERVICES), *args],
        env=settings.service_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    output = (result.stdout + result.stderr).strip()
    if result.returncode != 0:
        raise RuntimeError(f"services.py {' '.join(args)}: rc={result.returncode}: {output}")
    return "; ".join(line for line in output.splitlines() if line.startswith("[services]"))


def up(settings: Settings) -> str:
    return services(settings, "up")


def down(settings: Settings) -> str:
    return services(settings, "down")
