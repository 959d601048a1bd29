"""scripts/services.py's own logic, on a scratch .local: no service is started or stopped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_script(local: Path, code: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """`code` with scripts/services.py imported as `services`, its .local at `local`."""
    return subprocess.run(
        [sys.executable, "-c", f"import services\n{code}"],
        env={**os.environ, "OUTBOX_LOCAL_DIR": str(local), "PYTHONPATH": str(ROOT / "scripts")},
        check=check,
        text=True,
        capture_output=True,
        timeout=60,
    )


@pytest.fixture
def sleeper() -> Iterator[Any]:
    """Start a process of the given arguments (it only sleeps); killed after the test."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> int:
        proc = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)", *args],
            stdin=subprocess.DEVNULL,
        )
        started.append(proc)
        return proc.pid

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def test_a_stale_broker_pid_file_naming_a_stranger_is_not_the_broker(
    tmp_path: Path, sleeper: Any
) -> None:
    """After a reboot, the old pid may be any process's: `down` sent it SIGTERM, then
    SIGKILL."""
    (tmp_path / "kafka").mkdir()
    stranger = sleeper()
    (tmp_path / "kafka" / "kafka.pid").write_text(str(stranger))
    assert run_script(tmp_path, "print(services.kafka_pid())").stdout.strip() == "None"
    broker = sleeper("kafka.Kafka", str(tmp_path / "kafka" / "server.properties"))
    (tmp_path / "kafka" / "kafka.pid").write_text(str(broker))
    assert run_script(tmp_path, "print(services.kafka_pid())").stdout.strip() == str(broker)


def test_a_wait_for_a_process_that_died_fails_at_once_with_the_log_chosen_then(
    tmp_path: Path,
) -> None:
    """A broker's JVM that failed to start was waited for the whole 120 s, and the log shown
    was picked while it still ran (server.log), not the stdout its failure went to."""
    log = tmp_path / "stdout.log"
    log.write_text("Error: could not reserve the heap\n")
    code = (
        f"import pathlib\nlog = pathlib.Path({str(log)!r})\n"
        "services.wait_until('kafka', lambda: False, 120, lambda: log, alive=lambda: False)"
    )
    failed = run_script(tmp_path, code, check=False)
    assert failed.returncode != 0
    said = failed.stdout + failed.stderr
    assert "kafka exited" in said
    assert "could not reserve the heap" in said


def test_a_kraft_cluster_id_never_starts_with_a_dash(tmp_path: Path) -> None:
    """One random cluster id in 64 started with "-", which StorageTool's parser read as an
    option: format failed and with it `services up` (a CI run failed so)."""
    code = (
        "import uuid\n"
        # the first draw encodes to "-" first (0xf8: its first 6 bits are 62), the second not
        "draws = iter([uuid.UUID(bytes=b'\\xf8' + bytes(15)), uuid.UUID(bytes=bytes(16))])\n"
        "services.uuid.uuid4 = lambda: next(draws)\n"
        "print(services.kraft_cluster_id())\n"
    )
    assert run_script(tmp_path, code).stdout.strip() == "AAAAAAAAAAAAAAAAAAAAAA"


def test_the_services_ports_are_kept_from_outgoing_connections(tmp_path: Path) -> None:
    """In the kernel's ephemeral range, a port a test's connection happened to get made a
    restart's bind of that service fail (found by a review)."""
    reserved = tmp_path / "ip_local_reserved_ports"
    reserved.write_text("8080,9000-9010\n")
    code = (
        "from pathlib import Path\n"
        "services.os.geteuid = lambda: 0\n"
        f"services.RESERVED_PORTS = Path({str(reserved)!r})\n"
        "services.reserve_ports(9005, 55432, 59092)\n"
        "services.reserve_ports(55432)\n"  # reserved already: left as it is
    )
    run_script(tmp_path / "local", code)
    assert reserved.read_text() == "8080,9000-9010,55432,59092"


def test_a_process_left_stopped_is_resumed_not_waited_for(tmp_path: Path, sleeper: Any) -> None:
    """A test pauses the broker (SIGSTOP) mid-commit; killed meanwhile, it left the broker
    stopped, and `up` waited 120 s for it as for one starting, then failed every later run."""
    pid = sleeper("paused")
    os.kill(pid, signal.SIGSTOP)

    def state() -> str:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def becomes(stopped: bool) -> None:  # signals land asynchronously: the state lags a moment
        until = time.monotonic() + 10
        while (state() == "T") != stopped:
            assert time.monotonic() < until, f"state {state()}, stopped={stopped} expected"
            time.sleep(0.01)

    becomes(stopped=True)
    out = run_script(tmp_path, f"services.resume_if_stopped({pid}, 'kafka')")
    assert "kafka was stopped (SIGSTOP): resuming it" in out.stdout + out.stderr
    becomes(stopped=False)
    run_script(tmp_path, f"services.resume_if_stopped({pid}, 'kafka')")  # running: left alone
    run_script(tmp_path, "services.resume_if_stopped(None, 'kafka')")  # no broker: nothing


def test_a_process_killed_for_not_stopping_is_gone_when_terminate_returns(tmp_path: Path) -> None:
    """SIGKILL was sent and not waited for: `down` then `up` (a restart) checked the port while
    the dying broker still held it, and failed ("taken by another process")."""
    code = (
        "import subprocess, sys\n"
        "stubborn = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(1, flush=True); time.sleep(120)'],"
        " stdout=subprocess.PIPE)\n"
        "stubborn.stdout.readline()  # its SIGTERM handler is set\n"
        "services.terminate(stubborn.pid, lambda: stubborn.poll() is None, 0.2)\n"
        "print('gone' if stubborn.poll() is not None else 'alive')\n"
    )
    assert run_script(tmp_path, code).stdout.strip() == "gone"
