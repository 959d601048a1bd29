"""bench/_cpu.py: CPU by part from /proc, per record."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

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
