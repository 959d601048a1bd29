"""CPU time by part of the local stack, from /proc: what a benchmark's records cost the machine.

A rate on this 2-core machine mixes our code with the broker and Postgres beside it, and swings
by tens of percent within an hour. CPU per record, by part, says where the cost is, and how much
of the machine is left idle (it varies too, though less: a host's slow spell makes the same work
take more CPU). Linux only; elsewhere the parts come out empty.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    comm: str
    cmdline: str
    cpu_s: float  # user + system
    children_cpu_s: float  # of children it has waited for (exited)
    started: int = 0  # clock ticks after boot: with the pid, names one process (pids are reused)


def processes() -> Iterator[ProcStat]:
    """Every process alive now (those gone meanwhile are skipped)."""
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
        fields = rest.split()  # from the state on: fields[1] is the parent's pid
        utime, stime, cutime, cstime = (int(x) / TICK for x in fields[11:15])
        started = int(fields[19])
        yield ProcStat(
            int(name), int(fields[1]), comm, cmdline, utime + stime, cutime + cstime, started
        )


def _part(p: ProcStat, me: int, alive: dict[int, ProcStat], children: str) -> tuple[str, float]:
    """The part a process's CPU counts for (see sample()), and how much of it: this process's
    own time aside, which is the bench's."""
    if p.pid == me:
        return children, p.children_cpu_s
    if p.comm == "postgres":
        return "postgres", p.cpu_s + (
            p.children_cpu_s if p.ppid == 1 or " -D " in p.cmdline else 0.0
        )
    if "kafka.Kafka" in p.cmdline:
        return "broker", p.cpu_s
    seen = {p.pid}  # pids are read one by one, and reused: no loop, however they read
    up = p
    while up.ppid in alive and up.ppid not in seen:
        if up.ppid == me:
            return children, p.cpu_s + p.children_cpu_s
        up = alive[up.ppid]
        seen.add(up.pid)
    return "other", p.cpu_s + p.children_cpu_s


@dataclass(frozen=True)
class CpuSample:
    at: float  # time.monotonic()
    idle_s: float  # the machine's idle time, all cores
    by_part: dict[str, float] = field(default_factory=dict)


def sample(children: str = "children") -> CpuSample:
    """CPU seconds so far of: `bench` (this process, its client libraries' threads included),
    its descendants under the name given (a relay; Spark's JVM and the Python workers it forks),
    `postgres` (every server process, and the backends that exited, through the postmaster's
    children time), `broker` (the Kafka server) and `other`: every other process this one can
    see (kernel threads included; not interrupts, nor a hypervisor's steal). A run beside
    `make prebuild`'s background builds halved the baselines and doubled the broker's CPU per
    record; `other` says so in the figures themselves.
    The descendants and `other` count the children they have waited for too, as this process
    counts those it waited for among the descendants: a build's compilers, the JVM's workers
    come and go within a run, and a child's time stays in its part once it ended. (A
    descendant whose parent left first is adopted outside, and counts as `other` from then.)
    The parts are told by process, not by who asked for the work: another benchmark's or test
    run's load on the same Postgres and broker counts as `postgres` and `broker`."""
    return _sample_of(_scan(), children)


def _scan() -> dict[int, ProcStat]:
    return {p.pid: p for p in processes()}


def _sample_of(alive: dict[int, ProcStat], children: str) -> CpuSample:
    me = os.getpid()
    parts: dict[str, float] = {}
    for p in alive.values():
        if p.pid == me:
            parts["bench"] = parts.get("bench", 0.0) + p.cpu_s
        part, cpu = _part(p, me, alive, children)
        parts[part] = parts.get(part, 0.0) + cpu
    idle = 0.0
    if os.path.exists("/proc/stat"):
        with open("/proc/stat") as f:
            cpu_line = f.readline().split()  # cpu user nice system idle iowait ...
        idle = (int(cpu_line[4]) + int(cpu_line[5])) / TICK
    return CpuSample(time.monotonic(), idle, parts)


def per_record(before: CpuSample, after: CpuSample, records: int) -> dict[str, float]:
    """Microseconds of CPU per record by part, and the cores left idle meanwhile."""
    wall = after.at - before.at
    out = {
        f"{part}_us": round(
            (after.by_part[part] - before.by_part.get(part, 0.0)) / records * 1e6, 1
        )
        for part in sorted(after.by_part)
    }
    out["idle_cores"] = round((after.idle_s - before.idle_s) / wall, 2) if wall > 0 else 0.0
    return out


def work_us(per_record_cpu: dict[str, float], measuring: bool = False) -> float:
    """The CPU a record cost the stack, from per_record(): every part but `other` (work outside
    the run, a build's say) and the idle cores. The bench process's own part counts where it
    does the work (a baseline's client loop); `measuring`: it only watched a child do it (a
    relay's drain, polled every 10 ms), and is left out. Each part also holds what its process
    spends at rest (the broker's and Postgres's own background work), more per record the
    slower the run."""
    left_out = {"other_us", "bench_us"} if measuring else {"other_us"}
    return round(
        sum(v for k, v in per_record_cpu.items() if k.endswith("_us") and k not in left_out), 1
    )


def busy_elsewhere(seconds: float = 1.0, top: int = 3) -> tuple[float, list[str]]:
    """Cores spent on `other` (see sample()) over `seconds`, and the names of the `top`
    processes that spent the most of it, their children ended meanwhile included (a build's
    compilers)."""

    def scan() -> tuple[CpuSample, dict[tuple[int, int], ProcStat], set[tuple[int, int]]]:
        alive = _scan()
        others = {
            (p.pid, p.started): p
            for p in alive.values()
            if _part(p, os.getpid(), alive, "")[0] == "other"
        }
        return _sample_of(alive, ""), others, {(p.pid, p.started) for p in alive.values()}

    before, first, _ = scan()
    first_by_pid = {p.pid: p for p in first.values()}
    time.sleep(seconds)
    after, then, then_keys = scan()
    used: dict[str, float] = {}
    for key, p in then.items():
        was = first.get(key)  # a process born meanwhile spent all its time in the window
        since = 0.0 if was is None else was.cpu_s + was.children_cpu_s
        used[p.comm] = used.get(p.comm, 0.0) + p.cpu_s + p.children_cpu_s - since
    # A process that ended in the window moved its whole life to the children time of the
    # nearest ancestor still alive that waited for it (a make over gcc over cc1, both ended):
    # only what it spent in the window is that ancestor's. Capped at how much the ancestor's
    # children time rose: a parent that ignores SIGCHLD gets nothing.
    lives: dict[tuple[int, int], float] = {}
    for key, p in first.items():
        if key in then_keys:
            continue  # alive still (maybe exec'd into postgres: then no more `other`)
        up, seen = p, {p.pid}
        while up.ppid in first_by_pid and up.ppid not in seen:
            up = first_by_pid[up.ppid]
            seen.add(up.pid)
            if (up.pid, up.started) in then_keys:
                break
        home = (up.pid, up.started)
        if up is not p and home in then:
            lives[home] = lives.get(home, 0.0) + p.cpu_s + p.children_cpu_s
    for home, life in lives.items():
        rose = then[home].children_cpu_s - first[home].children_cpu_s
        used[then[home].comm] -= min(life, max(rose, 0.0))
    cores = (after.by_part.get("other", 0.0) - before.by_part.get("other", 0.0)) / (
        after.at - before.at
    )
    busiest = sorted((n for n in used if used[n] > 0), key=lambda n: -used[n])[:top]
    return max(cores, 0.0), busiest


def warn_if_busy(threshold: float = 0.25, seconds: float = 1.0) -> float:
    """Say on stderr when processes outside the stack keep the machine busy before a run (a
    build, another benchmark, a test run): its figures then say little. Returns the cores."""
    cores, busiest = busy_elsewhere(seconds)
    if cores > threshold:
        named = f" ({', '.join(busiest)})" if busiest else ""
        print(
            f"warning: {cores:.1f} cores busy outside the bench and its services{named}: "
            "the figures will not compare with a quiet machine's. "
            "make prebuild and prebuild-images build in the background for minutes "
            "(.local/prebuild-*.log).",
            file=sys.stderr,
            flush=True,
        )
    return cores
