"""`make run` (scripts/demo.py), the README's command for the sidecar end to end: it is run as a
newcomer runs it, and stopped with Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from scripts.demo import PROBE_PORT
from tests.fixtures.services import Services

ROOT = Path(__file__).resolve().parents[2]


def _sample(metrics: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples that carry these labels (0 when none)."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _metrics() -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PROBE_PORT}/metrics", timeout=2) as r:
            return str(r.read().decode())
    except OSError:  # the sidecar is not up yet
        return ""


def _until(condition: Callable[[], bool], seconds: float, what: str, output: list[str]) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            said = "".join(output)[-3000:]
            pytest.fail(f"{what} not within {seconds:g}s; the demo said:\n{said}")
        time.sleep(0.5)


def test_make_run_delivers_checks_back_and_stops_cleanly_on_ctrl_c(services: Services) -> None:
    """The sample shop's orders arrive in Kafka, its payments answered UNKNOWN are committed by
    the checker asking the shop's endpoint, and Ctrl-C stops the producer and the sidecar
    (gracefully, exit 0), leaving the services that ran before running."""
    if services.source != "script":
        pytest.skip(f"the demo starts the local services itself, not {services.source}'s")
    demo = subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "demo.py")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its sidecar too is killed if the test fails
    )
    assert demo.stdout is not None
    output: list[str] = []

    def read() -> None:  # the progress line is redrawn with \r: read it as it comes
        while chunk := os.read(demo.stdout.fileno(), 4096):  # type: ignore[union-attr]
            output.append(chunk.decode(errors="replace"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()

    def arrived() -> int:
        counts = re.findall(r"arrived in Kafka\s+(\d+)", "".join(output))
        return int(counts[-1]) if counts else 0

    try:
        _until(lambda: arrived() >= 30, 120, "30 records arrived", output)
        _until(
            lambda: _sample(_metrics(), "outbox_checker_checks_total", outcome="commit") >= 1,
            60,
            "a payment committed by a check-back",
            output,
        )
        metrics = _metrics()
        assert _sample(metrics, "outbox_relay_records_delivered_total", topic="demo.orders") >= 1
        assert _sample(metrics, "outbox_relay_records_delivered_total", topic="demo.payments") >= 1
        os.killpg(demo.pid, signal.SIGINT)  # Ctrl-C: to the foreground group, sidecar too
        assert demo.wait(90) == 0
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait(10)
        reader.join(10)
        demo.stdout.close()
    said = "".join(output)
    assert "Traceback" not in said, said[-3000:]
    assert re.search(r"sidecar exited with 0; published \d+ records", said), said[-3000:]
    assert "run on, as before" in said  # started by the tests: left running
