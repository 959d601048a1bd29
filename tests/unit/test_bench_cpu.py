"""bench/_cpu.py: CPU by part from /proc, per record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from bench._cpu import (
    TICK,
    CpuSample,
    ProcStat,
    busy_elsewhere,
    per_record,
    processes,
    sample,
    warn_if_busy,
    work_us,
)

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


def _ended(pid: int) -> bool:
    """Ended: reaped, or a zombie (whose /proc entry still says its times, until its parent
    waits for it; a container's first process may never)."""

    def state() -> str | None:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return None

    deadline = time.monotonic() + 10
    while state() not in (None, "Z") and time.monotonic() < deadline:
        time.sleep(0.01)
    return state() in (None, "Z")


@needs_proc
@pytest.mark.skipif(os.getpid() == 1, reason="the orphan would be adopted by this process")
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
            assert _ended(int(pid))
            after = sample(children="relay")
        finally:
            shell.kill()
    mine = after.by_part["relay"] - before.by_part.get("relay", 0.0)
    other = after.by_part["other"] - before.by_part.get("other", 0.0)
    assert 0.25 <= mine < 0.5
    assert other >= 0.25


def _proc(
    pid: int, ppid: int, cpu: float, waited: float = 0.0, comm: str = "x", started: int = 0
) -> ProcStat:
    return ProcStat(pid, ppid, comm, comm, cpu, waited, started)


def test_time_stays_in_its_part_when_a_process_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two samples: a relay's child ends (its time moves to the relay's children
    time), a child of the bench ends (to the bench's), a stranger ends (to init's); parents
    named in a loop (pids reused between reads) end nowhere."""
    me = os.getpid()
    init = 1
    before = [
        _proc(me, init, 5.0),
        _proc(200, me, 2.0),  # the relay
        _proc(300, 200, 1.0),  # its child, alive
        _proc(250, me, 0.3),  # another child of the bench, alive
        _proc(400, init, 0.5),  # a stranger (a compiler of a build), alive
        _proc(init, 0, 0.1, 10.0),
        _proc(500, init, 3.0, 1.0, comm="postgres"),
        _proc(700, 701, 0.2),
        _proc(701, 700, 0.2),
    ]
    after = [
        _proc(me, init, 5.5, 0.4),  # has waited for 250: 0.4 in all
        _proc(200, me, 2.5, 1.5),  # has waited for 300: 1.5 in all
        _proc(init, 0, 0.1, 10.8),  # has waited for 400: 0.8 in all
        _proc(500, init, 3.5, 1.0, comm="postgres"),
        _proc(700, 701, 0.2),
        _proc(701, 700, 0.2),
    ]
    monkeypatch.setattr("bench._cpu.processes", lambda: iter(before))
    first = sample(children="relay")
    monkeypatch.setattr("bench._cpu.processes", lambda: iter(after))
    second = sample(children="relay")
    moved = {part: round(second.by_part[part] - first.by_part[part], 6) for part in first.by_part}
    # relay 2.5 - 2.0, its child 1.5 - 1.0, the bench's child 0.4 - 0.3
    assert moved == {"bench": 0.5, "relay": 1.1, "other": 0.3, "postgres": 0.5}


def test_the_busiest_are_named_by_what_they_spent_in_the_window(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A kernel worker renames itself (kworker/0:1 to kworker/0:1-events) and a pid is
    reused: a process is told by its pid and start, not its name, so neither counts its whole
    life. A process that ended moves its life to the children time of the ancestor that
    waited for it (make, over a gcc and a cc1plus both ended), of which only the part spent
    in the window is the ancestor's; a parent that ignores SIGCHLD gets none of it."""
    n = 5_000_000  # above any real pid (4194304 at most): none is this test's own
    init = n + 1
    before = [
        _proc(init, 0, 0.1, 0.0, comm="init"),
        _proc(n + 10, n + 2, 1.0, comm="kworker/0:1", started=5),
        _proc(n + 20, init, 5.0, comm="cc1", started=7),  # ends after 0.4 s more
        _proc(n + 40, init, 0.2, comm="make", started=3),
        _proc(n + 41, n + 40, 0.1, comm="gcc", started=8),  # ends after 0.05 s more
        _proc(n + 42, n + 41, 3.0, comm="cc1plus", started=9),  # ends after 0.45 s more
        _proc(n + 50, init, 0.2, comm="bash", started=4),  # ignores SIGCHLD
        _proc(n + 51, n + 50, 0.3, comm="sleep", started=6),  # ends, reaped by the kernel
    ]
    after = [
        _proc(init, 0, 0.1, 5.4, comm="init"),
        _proc(n + 10, n + 2, 1.02, comm="kworker/0:1-events", started=5),
        _proc(n + 20, init, 0.6, comm="cc1", started=900),  # another cc1, in the pid left free
        _proc(n + 30, init, 0.3, comm="gopls", started=950),
        _proc(n + 40, init, 0.2, 3.6, comm="make", started=3),  # gcc's 0.15, cc1plus's 3.45
        _proc(n + 50, init, 0.9, comm="bash", started=4),
    ]
    # the window is a second that passes when slept
    slept = SimpleNamespace(now=False)
    monkeypatch.setattr("bench._cpu.processes", lambda: iter(after if slept.now else before))
    monkeypatch.setattr(
        "bench._cpu.time",
        SimpleNamespace(
            monotonic=lambda: float(slept.now), sleep=lambda _s: setattr(slept, "now", True)
        ),
    )
    cores, busiest = busy_elsewhere(top=6)
    # 0.4 + 0.6 + 0.3 + 0.02 + 0.05 + 0.45 + 0.7, less the 0.3 the kernel reaped away
    assert round(cores, 6) == 2.22
    assert busiest == ["bash", "cc1", "make", "init", "gopls", "kworker/0:1-events"]
    slept.now = False
    assert warn_if_busy(threshold=2.5) == pytest.approx(2.22)
    assert capsys.readouterr().err == ""
    slept.now = False
    warn_if_busy(threshold=2.0)
    said = capsys.readouterr().err
    assert said.startswith("warning: 2.2 cores busy outside the bench and its services "
                           "(bash, cc1, make): ")  # fmt: skip


@needs_proc
def test_a_process_is_told_by_its_start() -> None:
    """The start (clock ticks after boot) names a process with its pid: it stays as the
    process runs, and it is no later than now."""
    me = os.getpid()
    first = next(p for p in processes() if p.pid == me)
    _spin(0.05)
    again = next(p for p in processes() if p.pid == me)
    uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    assert first.started == again.started
    assert 0 < first.started <= uptime_s * TICK
    assert again.cpu_s > first.cpu_s  # the fields around it are read too


@needs_proc
@pytest.mark.skipif(os.getpid() == 1, reason="the spinner would be adopted by this process")
def test_a_process_busy_outside_the_stack_is_named(tmp_path: Path) -> None:
    """A build left running in the background (make prebuild's) halved a run's baselines and
    nothing said so: each benchmark says it first, naming what keeps the machine busy."""
    spin = "import time\nt = time.monotonic() + 20\nwhile time.monotonic() < t: pass\n"
    named = tmp_path / "busy-spinner"  # its process's name, whatever else runs here
    named.symlink_to(sys.executable)
    # not the bench's: its shell leaves it to be adopted, as a build's processes are
    started = subprocess.run(
        ["sh", "-c", '"$@" >/dev/null 2>&1 & echo $!', "sh", str(named), "-c", spin],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    spinner = int(started.stdout)
    try:
        cores, busiest = busy_elsewhere(top=1000)
    finally:
        os.kill(spinner, signal.SIGKILL)
    assert cores >= 0.5
    assert "busy-spinner" in busiest


def test_work_is_every_part_of_the_stack_but_other_and_idle() -> None:
    cpu = {"bench_us": 10.0, "relay_us": 50.0, "postgres_us": 30.5, "broker_us": 20.0,
           "other_us": 400.0, "idle_cores": 1.5}  # fmt: skip
    assert work_us(cpu) == 110.5
    assert work_us(cpu, measuring=True) == 100.5  # the bench's poll of a relay's drain: not work
    assert work_us({"idle_cores": 2.0}) == 0.0
