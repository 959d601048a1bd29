"""bench/_cpu.py: CPU by part from /proc, per record."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench._cpu import CpuSample, per_record, sample

needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="Linux /proc only")


def test_per_record_is_microseconds_by_part_and_the_idle_cores() -> None:
    before = CpuSample(at=10.0, idle_s=100.0, by_part={"bench": 1.0, "postgres": 2.0})
    after = CpuSample(at=12.0, idle_s=103.0, by_part={"bench": 1.5, "postgres": 2.25, "relay": 0.2})
    assert per_record(before, after, 1000) == {
        "bench_us": 500.0,
        "postgres_us": 250.0,
        "relay_us": 200.0,  # a part seen only at the end counts from zero
        "idle_cores": 1.5,
    }


def _spin(seconds: float) -> None:
    until = time.process_time() + seconds
    while time.process_time() < until:
        pass


@needs_proc
def test_this_process_and_its_children_are_counted_apart() -> None:
    with subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nt = time.process_time() + 0.3\n"
         "while time.process_time() < t: pass\nsys.stdout.write('spun\\n'); sys.stdout.flush()\n"
         "time.sleep(30)"],
        stdout=subprocess.PIPE, text=True,
    ) as child:  # fmt: skip
        try:
            before = sample(children="relay")
            _spin(0.2)
            assert child.stdout is not None
            assert child.stdout.readline() == "spun\n"
            after = sample(children="relay")
        finally:
            child.kill()
    assert after.by_part["bench"] - before.by_part["bench"] >= 0.15
    assert after.by_part["relay"] - before.by_part.get("relay", 0.0) >= 0.1
    assert after.at > before.at


SPIN = "import time\nt = time.process_time() + 0.3\nwhile time.process_time() < t: pass\n"


def _gone(pid: int) -> bool:
    """Ended and reaped (a zombie keeps its /proc entry until its parent waits for it)."""
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not Path(f"/proc/{pid}").exists()


@needs_proc
def test_a_descendant_counts_for_the_children_after_it_ended_and_a_stranger_as_other() -> None:
    """A relay's or Spark JVM's own children (the JVM forks Python workers) count for it, also
    once they ended; any other process on the machine counts as `other` (a build beside a run
    halved its baselines), also once it ended."""
    # A grandchild that spins once told, then ends (its shell waits for it: its time moves
    # to the shell's children time) ...
    spin_then_end = f"read go; {sys.executable} -c '{SPIN}'; echo spun; sleep 30"
    # ... and one whose parent left first: reparented, not ours any more
    orphan = (
        "import subprocess, sys\n"
        "subprocess.Popen([sys.executable, '-c', 'import os\\ninput()\\n' + "
        f"{SPIN!r} + 'print(\"spun\", os.getpid())'])"
    )
    pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    with (
        subprocess.Popen(["sh", "-c", spin_then_end], **pipes) as shell,
        subprocess.Popen([sys.executable, "-c", orphan], **pipes) as stranger,
    ):
        try:
            assert stranger.wait(30) == 0
            before = sample(children="relay")
            for started in (shell, stranger):
                assert started.stdin is not None
                started.stdin.write("go\n")
                started.stdin.flush()
            assert shell.stdout is not None
            assert stranger.stdout is not None
            assert shell.stdout.readline() == "spun\n"  # the shell has waited for it
            said, pid = stranger.stdout.readline().split()
            assert said == "spun"
            assert _gone(int(pid))  # reaped by its new parent
            after = sample(children="relay")
        finally:
            shell.kill()
    mine = after.by_part["relay"] - before.by_part.get("relay", 0.0)
    other = after.by_part["other"] - before.by_part.get("other", 0.0)
    assert 0.25 <= mine < 0.5
    assert other >= 0.25
