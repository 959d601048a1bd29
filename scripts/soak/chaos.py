"""The chaos driver: relays as `outboxctl relay` processes, and random harm to them and to the
stack, at random gaps, seeded.

Relay events: kill -9, SIGSTOP for longer than the lease then SIGCONT (the zombie a paused pod
is, design.md property 5), SIGTERM, a start, a blackout (every relay killed, none for 20-45 s:
a backlog builds, then drains). Stack events, one at a time, each at most `limits` times:
broker restart and kill -9, Postgres restart and immediate-mode crash, either one partitioned
(running, its packets dropped: root and iptables only). Every loop is bounded in
count and time; every process started here is stopped by `stop()` or `kill_all()`.
"""

from __future__ import annotations

import contextlib
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scripts import services as local_services
from scripts.soak import stack
from scripts.soak.settings import LEASE, OUTBOXCTL, Settings

TICK_S = 0.2
MAX_RELAYS = 3  # running or stopped: on 2 cores more only starve each other
SIGSTOP_S = (8.0, 25.0)  # the lease is 6 s: another relay takes the shards meanwhile
BLACKOUT_S = (20.0, 45.0)
SIGTERM_GRACE_S = 45.0  # the relay's shutdown grace is 10 s; beyond this it hangs: SIGKILL
RELAY_EVENTS = ("kill9", "start", "sigstop", "sigterm", "blackout")
# Each stack event as services.py commands, with a pause before the last: down a while.
STACK_EVENTS: dict[str, list[tuple[str, ...]]] = {
    "kafka_restart": [("restart", "kafka")],
    "pg_restart": [("restart", "postgres")],
    "kafka_kill9": [("crash", "kafka"), ("up",)],
    "pg_crash": [("crash", "postgres"), ("up",)],
    # Running but unreachable, as a failed host or a partition is: no reset, packets dropped.
    # Longer than the sidecar's 10 s dead-peer wait (database.connect_timeout_s): its
    # connections are given up and made anew; the broker's outlasts librdkafka's retries.
    "pg_partition": [("partition", "postgres"), ("heal", "postgres")],
    "kafka_partition": [("partition", "kafka"), ("heal", "kafka")],
}
DOWN_S = {"kafka_kill9": 5.0, "pg_crash": 3.0, "pg_partition": 15.0, "kafka_partition": 15.0}
# They need root and iptables: elsewhere the soak goes on without them.
PARTITIONS = ("pg_partition", "kafka_partition")


@dataclass(frozen=True)
class Plan:
    """How often each event is picked (relative weights), how often at most, and the gaps."""

    weights: dict[str, float]
    limits: dict[str, int]
    gap_s: tuple[float, float]  # between events
    stack_gap_s: float  # between stack events: the stack recovers, the relays catch up


PLAN = Plan(
    weights={"kill9": 3, "start": 3, "sigstop": 2, "sigterm": 2}
    | {"kafka_restart": 1.2, "kafka_kill9": 0.4, "pg_restart": 1.2, "pg_crash": 0.6}
    | {"pg_partition": 0.6, "kafka_partition": 0.6},
    limits={"kafka_restart": 3, "kafka_kill9": 1, "pg_restart": 3, "pg_crash": 2}
    | {"pg_partition": 1, "kafka_partition": 1},
    gap_s=(8, 25),
    stack_gap_s=75,
)
# --harsh: blackouts of every relay, more broker kills and Postgres crashes, shorter gaps.
HARSH = Plan(
    weights={"kill9": 2, "start": 3, "sigstop": 3, "sigterm": 1, "blackout": 1}
    | {"kafka_restart": 0.5, "kafka_kill9": 1.2, "pg_restart": 0.5, "pg_crash": 1.5}
    | {"pg_partition": 1, "kafka_partition": 1},
    limits={"blackout": 3, "kafka_restart": 1, "kafka_kill9": 2, "pg_restart": 1, "pg_crash": 3}
    | {"pg_partition": 2, "kafka_partition": 2},
    gap_s=(6, 18),
    stack_gap_s=45,
)


@dataclass
class Relay:
    id: str
    proc: subprocess.Popen[bytes]
    state: str = "running"  # running | stopped | terminating | ended
    since: float = 0.0  # monotonic time of the last change of state
    resume_at: float = 0.0  # for a stopped one: when it gets its SIGCONT


class Chaos:
    def __init__(
        self,
        settings: Settings,
        plan: Plan,
        rnd: random.Random,
        rundir: Path,
        log: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self.plan = plan
        self.rnd = rnd
        self.rundir = rundir  # the relays' logs go there
        self.log = log
        self.relays: list[Relay] = []
        self.counts: Counter[str] = Counter()  # events, and what the relays did
        self.events = 0
        self.blackout_until = 0.0
        self.last_stack_event = float("-inf")
        self.stack_thread: threading.Thread | None = None

    # --- relays --------------------------------------------------------------------------------

    def start_relay(self, why: str) -> Relay:
        rid = f"r{len(self.relays) + 1:03d}"
        with (self.rundir / f"relay-{rid}.log").open("ab") as log:
            proc = subprocess.Popen(
                [str(OUTBOXCTL), "relay"],
                env=self.settings.relay_env(rid),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the soak alone; it stops them in order
            )
        relay = Relay(rid, proc, since=time.monotonic())
        self.relays.append(relay)
        self.counts["relay_start"] += 1
        self.log(f"START relay {rid} pid {proc.pid} ({why})")
        return relay

    def live(self, *states: str) -> list[Relay]:
        return [r for r in self.relays if r.state in (states or ("running",))]

    def _signal(self, relay: Relay, sig: signal.Signals, state: str) -> None:
        with contextlib.suppress(ProcessLookupError):  # it just exited: reap() tells
            relay.proc.send_signal(sig)
        relay.state, relay.since = state, time.monotonic()

    def _kill(self, relay: Relay) -> None:
        with contextlib.suppress(ProcessLookupError):
            relay.proc.kill()  # SIGKILL: a stopped one dies too
        relay.proc.wait(10)
        relay.state, relay.since = "ended", time.monotonic()

    def reap(self) -> None:
        """Note exits, continue stopped relays that are due, SIGKILL one that ignores SIGTERM."""
        now = time.monotonic()
        for r in self.relays:
            if r.state == "ended":
                continue
            rc = r.proc.poll()
            if rc is not None:
                if r.state == "terminating":
                    self.log(f"EXITED relay {r.id} rc={rc} {now - r.since:.1f}s after SIGTERM")
                    # -15: the SIGTERM came before the relay had set its handler up
                    self.counts["sigterm_exit_ok" if rc in (0, -15) else "sigterm_exit_failed"] += 1
                else:
                    tail = (self.rundir / f"relay-{r.id}.log").read_text(errors="replace")
                    self.log(f"EXITED relay {r.id} rc={rc} unasked: {tail.splitlines()[-3:]}")
                    self.counts["relay_exit_unasked"] += 1
                r.state, r.since = "ended", now
            elif r.state == "stopped" and now >= r.resume_at:
                self.log(f"SIGCONT relay {r.id} after {now - r.since:.1f}s")
                self._signal(r, signal.SIGCONT, "running")
            elif r.state == "terminating" and now - r.since > SIGTERM_GRACE_S:
                self.log(f"relay {r.id} still runs {SIGTERM_GRACE_S:.0f}s after SIGTERM: SIGKILL")
                self.counts["sigterm_hung"] += 1
                self._kill(r)

    def keep_one(self) -> None:
        """No relay running and none stopped: a deployment would start one."""
        if not self.live() and not self.live("stopped") and time.monotonic() >= self.blackout_until:
            self.start_relay("none running")

    # --- events --------------------------------------------------------------------------------

    def kill9(self) -> bool:
        if not (running := self.live()):
            return False
        relay = self.rnd.choice(running)
        self._kill(relay)
        self.log(f"KILL9 relay {relay.id}")
        return True

    def start(self) -> bool:
        if len(self.live("running", "stopped")) >= MAX_RELAYS:
            return False
        self.start_relay("chaos")
        return True

    def sigstop(self) -> bool:
        if not (running := self.live()):
            return False
        relay = self.rnd.choice(running)
        pause = self.rnd.uniform(*SIGSTOP_S)
        self._signal(relay, signal.SIGSTOP, "stopped")
        relay.resume_at = time.monotonic() + pause
        self.log(f"SIGSTOP relay {relay.id} for {pause:.1f}s (lease {LEASE})")
        return True

    def sigterm(self) -> bool:
        if not (running := self.live()):
            return False
        relay = self.rnd.choice(running)
        self._signal(relay, signal.SIGTERM, "terminating")
        self.log(f"SIGTERM relay {relay.id}")
        return True

    def blackout(self) -> bool:
        """Every running relay killed -9, none started for a while (stopped ones stay stopped
        until their SIGCONT is due)."""
        pause = self.rnd.uniform(*BLACKOUT_S)
        for relay in self.live():
            self._kill(relay)
            self.log(f"KILL9 relay {relay.id} (blackout)")
        self.blackout_until = time.monotonic() + pause
        self.log(f"BLACKOUT no relay started for {pause:.1f}s")
        return True

    def stack_event(self, kind: str) -> bool:
        """In a thread, one at a time: the relays' chaos goes on while the stack recovers."""
        if self.stack_thread is not None and self.stack_thread.is_alive():
            return False
        if time.monotonic() - self.last_stack_event < self.plan.stack_gap_s:
            return False
        self.last_stack_event = time.monotonic()

        def run() -> None:
            t0 = time.monotonic()
            self.log(f"BEGIN {kind}")
            try:
                for i, command in enumerate(STACK_EVENTS[kind]):
                    if i:
                        time.sleep(DOWN_S[kind])
                    said = stack.services(self.settings, *command)
                    self.log(f"  services.py {' '.join(command)}: {said}")
                self.log(f"END {kind} in {time.monotonic() - t0:.1f}s")
            except Exception as exc:  # the run goes on: the drain shows whether it recovered
                self.log(f"FAILED {kind}: {exc!r}")
                self.counts["stack_event_failed"] += 1

        self.stack_thread = threading.Thread(target=run, name=kind, daemon=True)
        self.stack_thread.start()
        return True

    def fire(self, kind: str) -> bool:
        """The event `kind`, if it applies now; False if it does not (no relay to kill...)."""
        if kind in self.plan.limits and self.counts[kind] >= self.plan.limits[kind]:
            return False
        if kind in RELAY_EVENTS:
            done: bool = getattr(self, kind)()
        else:
            done = self.stack_event(kind)
        if done:
            self.events += 1
            self.counts[kind] += 1
        return done

    # --- phases --------------------------------------------------------------------------------

    def run(self, seconds: float, max_events: int) -> None:
        """Events at random gaps for `seconds`, at most `max_events` of them."""
        end = time.monotonic() + seconds
        next_event = time.monotonic() + self.rnd.uniform(10, 20)
        kinds = list(self.plan.weights)
        if not local_services.partitions_possible():
            kinds = [k for k in kinds if k not in PARTITIONS]
            self.log("no partitions: they need root and iptables (scripts/services up installs it)")
        weights = [self.plan.weights[k] for k in kinds]
        for _ in range(int(seconds / TICK_S) + 1):
            if time.monotonic() >= end or self.events >= max_events:
                break
            time.sleep(TICK_S)
            self.reap()
            self.keep_one()
            if time.monotonic() < max(next_event, self.blackout_until):
                continue
            if self.fire(self.rnd.choices(kinds, weights)[0]):
                next_event = time.monotonic() + self.rnd.uniform(*self.plan.gap_s)
        self.log(f"chaos ends: {self.events} events {dict(self.counts)}")

    def tend(self, done: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `done()`, at most `timeout_s`, reaping meanwhile: a SIGCONT due, an exit
        seen when it happens, a hung SIGTERM ended. False after the timeout."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            self.reap()
            time.sleep(TICK_S)
        return True

    def settle(self, relays: int) -> None:
        """The chaos over: stopped relays continued, the stack event done, `relays` running."""
        for relay in self.live("stopped"):
            relay.resume_at = 0.0
        self.blackout_until = 0.0
        thread = self.stack_thread
        self.tend(lambda: thread is None or not thread.is_alive(), 2 * stack.TIMEOUT_S + 10)
        self.reap()
        while len(self.live()) < relays:
            self.start_relay("drain")

    def stop(self) -> None:
        """SIGTERM every relay, as a rolling update would; SIGKILL those that outstay it."""
        for relay in self.live("stopped"):
            self._signal(relay, signal.SIGCONT, "running")
        for relay in self.live():
            self._signal(relay, signal.SIGTERM, "terminating")
            self.log(f"SIGTERM relay {relay.id} (end)")
        self.tend(lambda: not self.live("terminating"), SIGTERM_GRACE_S + 5)

    def kill_all(self) -> None:
        """Every relay still alive killed: the run is over (or aborted)."""
        for relay in self.relays:
            if relay.state != "ended":
                self._kill(relay)
        if self.stack_thread is not None:
            self.stack_thread.join(2 * stack.TIMEOUT_S + 10)
