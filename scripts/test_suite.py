"""The whole test suite as `make test-parallel` runs it: the Spark tests beside the rest, on a
stack of their own, then the chart's tests. (`make test` runs it in one session, serially.)

1. The unit and integration tests, on the stack `scripts/services.py up` started; their output
   is this script's. At the same time, the Spark tests, at a lower priority, on a second stack:
   a Postgres and a Kafka broker of their own (`.local/spark-stack`, ports 57432 and 61092-61095),
   started here and stopped at the end. Sharing one stack, two sessions would disturb each
   other: a relay's xid horizon is the whole Postgres server's (a transaction of one session
   holds back the other's deliveries), and each session deletes the test topics that appeared on
   its broker while it ran. Their output is printed when the integration tests end.
2. Then the chart's tests (tests/deploy), alone: they wait for the image and Go builds `make
   test-parallel` starts in the background, and run the sidecar on the first stack.

Every step runs even if one before it failed; the exit status is 0 only if all passed.
`.venv/bin/python -m pytest` still runs the whole suite in one session, one test at a time.
Only the standard library is used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "scripts" / "services.py"
# The Spark tests' stack: services.py's own variables move it off the first stack's ports and data
SPARK_STACK = {
    "OUTBOX_LOCAL_DIR": ".local/spark-stack",
    "OUTBOX_PG_PORT": "57432",
    "OUTBOX_KAFKA_PORT": "61092",
    "OUTBOX_KAFKA_CONTROLLER_PORT": "61093",
}
SPARK_NICENESS = 5  # the integration tests' deadlines are the tighter ones
STACK_TIMEOUT_S = 600  # a first `up` resolves the broker's and the connector's jars with Maven


def say(message: str) -> None:
    print(f"[test_suite] {message}", flush=True)


def pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", *args]


def spark_stack(command: str) -> dict[str, str]:
    """Run `services.py COMMAND` on the Spark tests' stack; for `up`, the environment that points
    the tests at it (the lines `up` prints)."""
    done = subprocess.run(
        [sys.executable, str(SERVICES), command],
        env={**os.environ, **SPARK_STACK},
        capture_output=True,
        text=True,
        timeout=STACK_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"services.py {command} of the Spark tests' stack failed (rc={done.returncode}):\n"
            f"{done.stdout}{done.stderr}"
        )
    said = (line.split("=", 1) for line in done.stdout.splitlines() if line.startswith("OUTBOX_"))
    return {**SPARK_STACK, **dict(said)}


def start_spark_tests(log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, **spark_stack("up")}
    with log.open("wb") as out:
        return subprocess.Popen(
            ["nice", "-n", str(SPARK_NICENESS), *pytest("tests/spark")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C reaches it through interrupt() only
        )


def interrupt(process: subprocess.Popen[bytes]) -> None:
    """SIGINT, as a Ctrl-C: pytest stops, its fixtures cleaning up (relays, clusters, rules)."""
    if process.poll() is None:
        process.send_signal(signal.SIGINT)


def ended(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait for an interrupted pytest to clean up; killed if it has not ended by then."""
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def main() -> int:
    log = ROOT / SPARK_STACK["OUTBOX_LOCAL_DIR"] / "pytest.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    say(f"the Spark tests run beside the others on a stack of their own (output: {log})")
    try:
        spark: subprocess.Popen[bytes] | None = start_spark_tests(log)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        say(f"the Spark tests cannot run: {exc}")
        spark = None
    rest = subprocess.Popen(pytest("tests/unit", "tests/integration"), cwd=ROOT)
    try:
        rest_rc = rest.wait()
        if spark and spark.poll() is None:
            say("the unit and integration tests are done: waiting for the Spark tests")
        spark_rc = spark.wait() if spark else 1
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):  # a Ctrl-C reached the foreground pytest too
            interrupt(rest)
        if spark:
            interrupt(spark)
        ended(rest, 120)
        if spark:
            # PySpark's own SIGINT handler cancels the running Spark job and the session goes
            # on; killed, its JVM ends with it (stdin closed) and `down` below removes the rest.
            ended(spark, 30)
        raise
    finally:
        try:
            spark_stack("down")
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            say(f"stopping the Spark tests' stack: {exc}")
    if spark:
        say(f"the Spark tests' output, from {log}:")
        sys.stdout.write(log.read_text(errors="replace"))
    say(f"the unit, integration and Spark tests took {time.monotonic() - started:.0f} s")
    deploy = subprocess.Popen(pytest("tests/deploy"), cwd=ROOT)
    try:
        deploy_rc = deploy.wait()
    except KeyboardInterrupt:
        ended(deploy, 120)
        raise
    results = {"unit and integration": rest_rc, "Spark": spark_rc, "chart": deploy_rc}
    failed = [name for name, rc in results.items() if rc != 0]
    if failed:
        say(f"failed: the {', the '.join(failed)} tests")
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        say("interrupted")
        sys.exit(130)
