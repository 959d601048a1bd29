"""Start, stop and describe the real local stack: PostgreSQL, a KRaft Kafka broker, Spark's jars.

Usage: scripts/services up|down|status|env|spark-jars|helm|promtool|restart postgres|kafka
                        crash postgres|kafka
                        partition postgres|kafka|heal postgres|kafka

`partition` leaves the service running but unreachable, as a failed host or a network partition
is (its port's packets dropped, with iptables, as root); `heal` ends it, and so does `up`.

`up` also starts a PgBouncer in transaction pooling in front of that Postgres
(OUTBOX_PGBOUNCER_PORT, default the Postgres port + 1), when it can be installed: the tests of
the sidecar's `database.transaction_pooling` go through it.

`helm` prints the path of a Helm binary for the chart's tests: one on the PATH, else one built
with `go install` into `.local/bin` (Helm is a Go module; the Go toolchain fetches it); `promtool`
likewise Prometheus's, with which they evaluate the chart's alert rules. The chart's tests also
start a Kubernetes API server, with `scripts/kube.py`; `down` stops it too.

Everything lives under `.local/` (ignored by git): binaries' data, resolved jars, logs, pid files.
OUTBOX_LOCAL_DIR moves it (relative to the repository's root), so that a second stack on ports of
its own can run beside this one (the chaos soak's, `python -m scripts.soak`).
`up` is idempotent: what exists is reused and what runs is left running, so a second call returns in
seconds. Only the standard library is used, so this runs before the project's virtualenv exists.

Ports (loopback only) move with OUTBOX_PG_PORT, OUTBOX_KAFKA_PORT, OUTBOX_KAFKA_CONTROLLER_PORT and
OUTBOX_KAFKA_SASL_PORT (default: the Kafka port + 2) and OUTBOX_KAFKA_SSL_PORT (+ 3): listeners
of the broker that take SASL PLAIN logins, in clear and over TLS (a self-signed certificate made
with the JDK's keytool), so that the relay's and the Spark job's Kafka secrets and TLS settings
are tested for real.
"""

from __future__ import annotations

import base64
import fcntl
import glob
import hashlib
import os
import pwd
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parent.parent
LOCAL = ROOT / (os.environ.get("OUTBOX_LOCAL_DIR") or ".local")  # empty: the default, not ROOT
HOST = "127.0.0.1"
PG_PORT = int(os.environ.get("OUTBOX_PG_PORT", "55432"))
PGBOUNCER_PORT = int(os.environ.get("OUTBOX_PGBOUNCER_PORT") or PG_PORT + 1)
KAFKA_PORT = int(os.environ.get("OUTBOX_KAFKA_PORT", "59092"))
CONTROLLER_PORT = int(os.environ.get("OUTBOX_KAFKA_CONTROLLER_PORT", "59093"))
KAFKA_SASL_PORT = int(os.environ.get("OUTBOX_KAFKA_SASL_PORT") or KAFKA_PORT + 2)
KAFKA_SSL_PORT = int(os.environ.get("OUTBOX_KAFKA_SSL_PORT") or KAFKA_PORT + 3)
# The SASL listener's one login: a loopback test broker's, not a secret.
SASL_USER, SASL_PASSWORD = "outbox-test", "outbox-test-secret"

PG_DIR = LOCAL / "postgres"
PG_DATA = PG_DIR / "data"
PG_LOG = PG_DIR / "postgres.log"
PGBOUNCER_DIR = LOCAL / "pgbouncer"
PGBOUNCER_INI = PGBOUNCER_DIR / "pgbouncer.ini"
PGBOUNCER_LOG = PGBOUNCER_DIR / "pgbouncer.log"
PGBOUNCER_PID = PGBOUNCER_DIR / "pgbouncer.pid"
KAFKA_DIR = LOCAL / "kafka"
KAFKA_LIBS = KAFKA_DIR / "libs"
KAFKA_DATA = KAFKA_DIR / "data"
KAFKA_LOGS = KAFKA_DIR / "logs"
KAFKA_PID = KAFKA_DIR / "kafka.pid"
KAFKA_TLS = KAFKA_DIR / "tls"
KAFKA_KEYSTORE = KAFKA_TLS / "broker.p12"
KAFKA_CA = KAFKA_TLS / "ca.pem"  # the broker's self-signed certificate: what clients trust
KEYSTORE_PASSWORD = "outbox-test-keystore"  # noqa: S105 (a loopback test broker's, not a secret)
SPARK_JARS = LOCAL / "spark-jars"
JVM_POMS = ROOT / "scripts" / "jvm"

# Settings the design needs: commit timestamps order rows by commit (property 4), logical WAL
# keeps logical decoding open as an option. fsync stays on: crash tests must mean something.
PG_SETTINGS = {
    "listen_addresses": HOST,
    "port": str(PG_PORT),
    "unix_socket_directories": "",
    "track_commit_timestamp": "on",
    "wal_level": "logical",
    "max_connections": "300",
    "max_prepared_transactions": "10",  # two-phase commit, as some applications use it
    "max_replication_slots": "10",
    "max_wal_senders": "10",
    "shared_buffers": "256MB",
    "log_min_duration_statement": "-1",
    "logging_collector": "off",
}


def log(msg: str) -> None:
    print(f"[services] {msg}", flush=True)


def fail(msg: str) -> NoReturn:
    print(f"[services] error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


def wait_until(
    what: str,
    check: Callable[[], object],
    timeout: float,
    log_file: Path | Callable[[], Path] | None = None,
    alive: Callable[[], object] | None = None,
) -> None:
    """Until `check()` holds; fails after `timeout`, or at once when `alive()` no longer holds
    (a process that died: not waited for to the end), with the tail of `log_file`, which may
    be chosen only then (a JVM that failed to start writes its stdout, not its log)."""
    deadline = time.monotonic() + timeout
    ended = False
    while time.monotonic() < deadline:
        if check():
            return
        if alive is not None and not alive():
            ended = True
            break
        time.sleep(0.25)
    log_path = log_file() if callable(log_file) else log_file
    tail = ""
    if log_path and log_path.exists():
        tail = "\n" + "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
    fail(f"{what} {'exited' if ended else f'did not answer within {timeout:.0f}s'}{tail}")


KILLED_GONE_S = 10.0  # a SIGKILLed process is gone within this (its sockets with it)


def terminate(pid: int, alive: Callable[[], object], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if `alive()` still holds after `timeout_s`, and a wait for it to
    be gone: a port check right after the SIGKILL saw the dying process's socket ("taken by
    another process")."""
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive():
        time.sleep(0.1)
    if alive():
        os.kill(pid, signal.SIGKILL)
        killed_by = time.monotonic() + KILLED_GONE_S
        while time.monotonic() < killed_by and alive():
            time.sleep(0.1)


def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, check=True, text=True, **kw)


def apt_get(
    sudo: list[str], *args: str, check: bool = True, **kw: Any
) -> subprocess.CompletedProcess[str]:
    """apt-get, one at a time among our scripts: `make test` builds the images in the background
    (scripts/image.py installs podman) while `up` installs, and dpkg refuses a second at once.
    DPkg::Lock::Timeout waits for anyone else's (an unattended upgrade) instead of failing."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    command = [*sudo, "apt-get", "-o", "DPkg::Lock::Timeout=600", *args]
    with build_lock("apt"):
        return subprocess.run(
            command, check=check, text=True, env=env, stdout=subprocess.DEVNULL, **kw
        )


# --- PostgreSQL -------------------------------------------------------------------------------


def pg_bindir() -> Path | None:
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name)
    )
    if candidates:
        return Path(candidates[-1])
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def install_postgres() -> Path:
    bindir = pg_bindir()
    if bindir and (bindir / "postgres").exists():
        return bindir
    log("PostgreSQL is not installed: installing it from Debian's packages")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and not shutil.which("sudo"):
        fail("PostgreSQL is missing and installing it needs root: run `apt-get install postgresql`")
    try:
        apt_get(sudo, "update", "-q")
        apt_get(sudo, "install", "-y", "-q", "--no-install-recommends", "postgresql")
    except subprocess.CalledProcessError as exc:  # sudo wants a password, say
        fail(
            f"installing PostgreSQL failed ({' '.join(exc.cmd)} exited {exc.returncode}): "
            "run `sudo apt-get install postgresql`, then this again"
        )
    bindir = pg_bindir()
    if not bindir:
        fail("PostgreSQL was installed but no initdb was found under /usr/lib/postgresql")
    return bindir


def pg_user_prefix() -> list[str]:
    """Postgres refuses to run as root; as root we run it as the `postgres` system user."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "postgres"])
    return ["runuser", "-u", "postgres", "--"]


def pg_running() -> bool:
    return port_open(PG_PORT)


def pg_ready(bindir: Path) -> bool:
    r = subprocess.run(
        [str(bindir / "pg_isready"), "-h", HOST, "-p", str(PG_PORT), "-U", "postgres"],
        capture_output=True,
    )
    return r.returncode == 0


def pg_is_ours(bindir: Path) -> bool:
    psql = [
        str(bindir / "psql"),
        "-X",
        "-w",
        "-At",
        "-h",
        HOST,
        "-p",
        str(PG_PORT),
        "-U",
        "postgres",
    ]
    shown = subprocess.run(
        [*psql, "-d", "postgres", "-c", "SHOW data_directory"],
        capture_output=True,
        text=True,
    )
    if shown.returncode != 0:
        return False
    return Path(shown.stdout.strip()).resolve() == PG_DATA.resolve()


RESERVED_PORTS = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")


def reserve_ports(*ports: int) -> None:
    """Keeps the kernel from giving these ports to outgoing connections (as root; else
    nothing). They are in its ephemeral range (32768-60999 by default): a test's connection
    that happened to get one, still open, made a restart's bind of that service fail."""
    if os.geteuid() != 0:
        return
    try:
        held = RESERVED_PORTS.read_text().strip()
        covered: set[int] = set()
        for item in filter(None, held.split(",")):
            lo, _, hi = item.partition("-")
            covered.update(range(int(lo), int(hi or lo) + 1))
        missing = sorted(set(ports) - covered)
        if missing:
            RESERVED_PORTS.write_text(",".join([*filter(None, [held]), *map(str, missing)]))
    except (OSError, ValueError) as exc:  # a container's read-only /proc/sys: as before
        log(f"could not reserve ports {sorted(ports)} for the services: {exc}")


def rollback_stale_prepared(
    bindir: Path, *, older_than: str = "10 min", database: str | None = None
) -> None:
    """Rolls back transactions prepared (two-phase commit) over `older_than` ago (in `database`
    only, if given): left by a killed test run, one survives restarts and holds the xid horizon
    of the whole cluster back, and no relay of this Postgres delivered anything again (a test's
    lives for seconds)."""
    # -X: a user's ~/.psqlrc (\timing on, say) added lines to the output parsed here
    psql = [str(bindir / "psql"), "-X", "-v", "ON_ERROR_STOP=1", "-h", HOST, "-p", str(PG_PORT)]
    psql += ["-U", "postgres", "-d"]
    query = (  # on stdin: psql quotes its variables (:'age') there, not in -c
        "SELECT database, gid FROM pg_prepared_xacts WHERE prepared < now() - :'age'::interval"
        " AND database = coalesce(nullif(:'db', ''), database)"
    )
    listed = subprocess.run(
        [*psql, "postgres", "-AtF", "\t", "-v", f"age={older_than}", "-v", f"db={database or ''}"],
        input=query,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:
        log(f"could not list the prepared transactions: {listed.stderr.strip()}")
        return
    for line in listed.stdout.splitlines():
        name, _, gid = line.partition("\t")
        quoted = "'" + gid.replace("'", "''") + "'"
        done = subprocess.run(
            [*psql, name, "-c", f"ROLLBACK PREPARED {quoted}"], capture_output=True, text=True
        )
        if done.returncode == 0:
            log(f"rolled back transaction {gid!r}, prepared in {name} by an earlier run")
        else:
            log(f"could not roll back transaction {gid!r} in {name}: {done.stderr.strip()}")


# The synchronous standby tests/integration/test_relay_commit_wait.py names, which never answers:
# left set by a run killed in that test, every later commit would wait for it.
NO_STANDBY = "outbox_test_no_standby"


def release_commits_left_waiting(bindir: Path) -> None:
    psql = [str(bindir / "psql"), "-X", "-h", HOST, "-p", str(PG_PORT), "-U", "postgres", "-At"]
    shown = subprocess.run(
        [*psql, "-c", "SHOW synchronous_standby_names"], capture_output=True, text=True
    )
    if shown.stdout.strip() != NO_STANDBY:
        return
    for statement in ("ALTER SYSTEM RESET synchronous_standby_names", "SELECT pg_reload_conf()"):
        done = subprocess.run([*psql, "-c", statement], capture_output=True, text=True)
        if done.returncode != 0:  # said, not fatal: the commits it would release hang instead
            log(f"could not clear synchronous_standby_names = {NO_STANDBY}: {done.stderr.strip()}")
            return
    log(f"cleared synchronous_standby_names = {NO_STANDBY}, left by a killed test run")


def postgres_up() -> None:
    bindir = install_postgres()
    prefix = pg_user_prefix()
    if pg_running() and (PG_DATA / "postmaster.pid").exists():
        # ours, starting or in crash recovery (an `up` of another process): wait for it
        wait_until("postgres", lambda: pg_ready(bindir), 60, PG_LOG)
    if pg_running() and pg_ready(bindir):
        if not pg_is_ours(bindir):  # another checkout's, say: its prepared transactions and
            # databases are not ours to roll back and drop
            fail(
                f"port {PG_PORT} is taken by a PostgreSQL whose data is not {PG_DATA}; "
                "set OUTBOX_PG_PORT"
            )
        log(f"postgres already running on {HOST}:{PG_PORT}")
        release_commits_left_waiting(bindir)
        rollback_stale_prepared(bindir)
        return
    if pg_running():
        fail(f"port {PG_PORT} is taken by another process; set OUTBOX_PG_PORT")
    PG_DIR.mkdir(parents=True, exist_ok=True)
    if prefix:
        # the postgres user must reach its data directory through the checkout
        for parent in [PG_DIR, *PG_DIR.parents]:
            if parent == Path("/"):
                break
            mode = parent.stat().st_mode
            if not mode & 0o001:
                parent.chmod(mode | 0o001)
        shutil.chown(PG_DIR, "postgres", "postgres")
    if not (PG_DATA / "PG_VERSION").exists():
        log(f"creating a PostgreSQL cluster in {PG_DATA}")
        run(
            [
                *prefix,
                str(bindir / "initdb"),
                "-D",
                str(PG_DATA),
                "-U",
                "postgres",
                "--auth=trust",
                "--encoding=UTF8",
                "--locale=C.UTF-8",
            ],
            stdout=subprocess.DEVNULL,
        )
    opts = " ".join(f"-c {k}={v!s}" if v else f"-c {k}=''" for k, v in PG_SETTINGS.items())
    run(
        [
            *prefix,
            str(bindir / "pg_ctl"),
            "-D",
            str(PG_DATA),
            "-l",
            str(PG_LOG),
            "-o",
            opts,
            "-w",
            "-t",
            "60",
            "start",
        ],
        stdout=subprocess.DEVNULL,
    )
    wait_until("postgres", lambda: pg_ready(bindir), 60, PG_LOG)
    release_commits_left_waiting(bindir)
    rollback_stale_prepared(bindir)
    log(f"postgres ready on {HOST}:{PG_PORT} (log: {PG_LOG})")


def postgres_down(mode: str = "fast") -> None:
    """Stop postgres; mode "immediate" is a crash: no shutdown checkpoint, recovery at start."""
    bindir = pg_bindir()
    if not bindir or not (PG_DATA / "postmaster.pid").exists():
        return
    subprocess.run(
        [*pg_user_prefix(), str(bindir / "pg_ctl"), "-D", str(PG_DATA), "-m", mode, "-w", "stop"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    log("postgres stopped" if mode == "fast" else f"postgres stopped ({mode})")


# --- Tools from Debian's packages ------------------------------------------------------------


def installed(binary: str) -> Path | None:
    found = shutil.which(binary) or f"/usr/sbin/{binary}"  # sbin: off a non-root user's PATH
    return Path(found) if Path(found).exists() else None


def debian_tool(package: str, binary: str, what: str) -> Path | None:
    """`binary`, installed from Debian's package if missing; optional: without root or apt, a
    line says so (the tests that need it are skipped) and None comes back."""
    if path := installed(binary):
        return path
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    if sudo and not shutil.which("sudo"):
        log(f"{what} is not installed and installing it needs root: its tests are skipped")
        return None
    log(f"{what} is not installed: installing it from Debian's packages")
    install = ("install", "-y", "-q", "--no-install-recommends", package)
    quiet: dict[str, Any] = {"check": False, "stderr": subprocess.DEVNULL}
    if apt_get(sudo, *install, **quiet).returncode != 0:  # package lists stale on a new machine
        apt_get(sudo, "update", "-q", **quiet)
        if apt_get(sudo, *install, **quiet).returncode != 0:  # optional: said, not fatal
            log(f"installing {what} failed (`apt-get {' '.join(install)}`): its tests are skipped")
    return installed(binary)


# --- Network partitions (iptables) -----------------------------------------------------------
# A host that failed, or a partition, answers nothing: no reset, no FIN, its peers' data goes
# unacknowledged. Dropping a loopback port's packets, both ways, is that for whoever talks to it
# (the failover tests' Postgres, the soak's stack). Root and iptables only: `up` installs it.

# This stack's rules carry its tag, so that its `up` and `down` remove every one left behind (a
# test killed mid-partition), and no other stack's (the soak's runs beside the tests').
PARTITION_TAG = "outbox-partition-" + hashlib.sha256(str(LOCAL).encode()).hexdigest()[:12]


def partitions_possible() -> bool:
    return _iptables() is not None


def _iptables() -> Path | None:
    """The legacy tables first, which kernels without nftables have, then whatever `iptables`
    is; the first that can list its rules."""
    for binary in ("iptables-legacy", "iptables"):
        path = installed(binary)
        if path and _quiet([str(path), "-w", "-L", "OUTPUT", "-n"]) == 0:
            return path
    return None


def _quiet(cmd: list[str]) -> int:
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode


def _partition_rules(port: int) -> list[list[str]]:
    return [
        [
            *("OUTPUT", "-p", "tcp", "-o", "lo", f"--{way}", str(port)),
            *("-m", "comment", "--comment", PARTITION_TAG, "-j", "DROP"),
        ]
        for way in ("dport", "sport")
    ]


def partition(port: int) -> bool:
    """Drop every packet to and from `port` until heal(port). False if it cannot (no root, no
    iptables): nothing was changed."""
    iptables = _iptables()
    if iptables is None:
        return False
    for rule in _partition_rules(port):
        if _quiet([str(iptables), "-w", "-I", *rule]) != 0:
            heal(port)
            return False
    return True


def heal(port: int | None = None) -> None:
    """Remove the rules partition(port) added, however many times it was called; without a
    port, every rule of this stack's, whatever its port."""
    iptables = _iptables()
    if iptables is None:
        return
    if port is not None:
        for rule in _partition_rules(port):
            while _quiet([str(iptables), "-w", "-D", *rule]) == 0:
                pass
        return
    listed = subprocess.run(
        [str(iptables), "-w", "-S", "OUTPUT"], capture_output=True, text=True, check=False
    ).stdout
    for line in listed.splitlines():
        words = shlex.split(line)
        if PARTITION_TAG in words and words[:2] == ["-A", "OUTPUT"]:
            _quiet([str(iptables), "-w", "-D", *words[1:]])


def stop_failover_clusters() -> None:
    """The failover tests' own primaries and standbys (tests/fixtures/pg_failover.py), left
    running by a test run that was killed: stopped, and their data removed."""
    bindir = pg_bindir()
    for data in sorted(LOCAL.glob("failover/*/*/postmaster.pid")):
        if bindir is not None:
            pg_ctl = [*pg_user_prefix(), str(bindir / "pg_ctl"), "-D", str(data.parent)]
            _quiet([*pg_ctl, "-m", "immediate", "-w", "stop"])
    for run_dir in LOCAL.glob("failover/*"):
        shutil.rmtree(run_dir, ignore_errors=True)


# --- PgBouncer, in transaction pooling ----------------------------------------------------------
# In front of the Postgres above, as many deployments put it: the relay's and checker's
# `database.transaction_pooling` setting is tested through it. Optional: without it (no root to
# install it), `up` says so and the tests that need it are skipped.


def pgbouncer_bin() -> Path | None:
    return installed("pgbouncer")


def install_pgbouncer() -> Path | None:
    return debian_tool("pgbouncer", "pgbouncer", "PgBouncer")


def pgbouncer_config() -> str:
    """Transaction pooling with a small pool, so that clients really share server connections
    (what breaks prepared statements and LISTEN); any database, trusting the loopback's users
    as the Postgres above does (PgBouncer still wants each user in its auth_file)."""
    return f"""[databases]
* = host={HOST} port={PG_PORT}

[pgbouncer]
listen_addr = {HOST}
listen_port = {PGBOUNCER_PORT}
unix_socket_dir =
auth_type = trust
auth_file = {PGBOUNCER_DIR / "users.txt"}
pool_mode = transaction
default_pool_size = 4
max_client_conn = 200
server_login_retry = 1
# How long a statement may wait for a server connection (default 120 s): while Postgres was
# down, a relay's statement waited that long, past its shutdown grace (README, Behind PgBouncer)
query_wait_timeout = 10
ignore_startup_parameters = extra_float_digits
logfile = {PGBOUNCER_LOG}
pidfile = {PGBOUNCER_PID}
"""


def pgbouncer_pid() -> int | None:
    """PgBouncer's pid, if its pid file names a running PgBouncer (not a stranger reusing it)."""
    try:
        pid = int(PGBOUNCER_PID.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if b"pgbouncer" in cmdline and str(PGBOUNCER_INI).encode() in cmdline else None


def pgbouncer_up() -> bool:
    binary = install_pgbouncer()
    if binary is None:
        return False
    if pgbouncer_pid() is not None and port_open(PGBOUNCER_PORT):
        log(f"pgbouncer already running on {HOST}:{PGBOUNCER_PORT}")
        return True
    if port_open(PGBOUNCER_PORT):  # optional: said, and its tests are skipped
        log(
            f"port {PGBOUNCER_PORT} is taken by another process (set OUTBOX_PGBOUNCER_PORT): "
            "pgbouncer not started, its tests are skipped"
        )
        return False
    PGBOUNCER_DIR.mkdir(parents=True, exist_ok=True)
    # Not ours (pgbouncer_pid said so): a pid file naming any live process, after a reboot
    # reused its pid, made PgBouncer refuse to start ("another instance running?").
    PGBOUNCER_PID.unlink(missing_ok=True)
    PGBOUNCER_INI.write_text(pgbouncer_config())
    (PGBOUNCER_DIR / "users.txt").write_text('"postgres" ""\n')
    prefix = pg_user_prefix()  # it refuses to run as root, as Postgres does
    if prefix:
        for path in (PGBOUNCER_DIR, *PGBOUNCER_DIR.iterdir()):
            shutil.chown(path, "postgres", "postgres")
    started = subprocess.run(
        [*prefix, str(binary), "-d", str(PGBOUNCER_INI)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while started.returncode == 0 and not port_open(PGBOUNCER_PORT):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    if started.returncode != 0 or not port_open(PGBOUNCER_PORT):  # optional: said, not fatal
        said = started.stderr.strip() or f"see {PGBOUNCER_LOG}"
        log(f"pgbouncer did not start ({said}): its tests are skipped")
        return False
    log(f"pgbouncer (transaction pooling) ready on {HOST}:{PGBOUNCER_PORT} (log: {PGBOUNCER_LOG})")
    return True


def pgbouncer_down() -> None:
    pid = pgbouncer_pid()
    if pid is None:
        return
    terminate(pid, lambda: pgbouncer_pid(), 10)
    log("pgbouncer stopped")


# --- Kafka ------------------------------------------------------------------------------------


def mvn_copy(pom: Path, dest: Path, *props: str) -> None:
    if not shutil.which("mvn"):
        fail("Maven (mvn) is needed to resolve the Kafka and Spark jars; install Maven and Java 17")
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    log(f"resolving jars for {pom.parent.name} with Maven into {dest}")
    result = subprocess.run(
        [
            "mvn",
            "-B",
            "-q",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp}",
            "-DincludeScope=runtime",
            *props,
        ],
        text=True,
        capture_output=True,
    )
    if result.returncode != 0:
        fail(f"Maven could not resolve {pom}:\n{result.stdout[-4000:]}{result.stderr[-2000:]}")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)  # only a complete set of jars ever appears under dest


def kafka_jars() -> None:
    stamp = KAFKA_LIBS / ".pom"
    pom = JVM_POMS / "kafka" / "pom.xml"
    if stamp.exists() and stamp.read_text() == pom.read_text():
        return
    mvn_copy(pom, KAFKA_LIBS)
    stamp.write_text(pom.read_text())


def kafka_tls() -> None:
    """The SASL_SSL listener's key and certificate (for 127.0.0.1 and localhost, ten years),
    made once with keytool: the JDK the broker needs has it, openssl may be missing."""
    if KAFKA_KEYSTORE.exists() and KAFKA_CA.exists():
        return
    shutil.rmtree(KAFKA_TLS, ignore_errors=True)
    KAFKA_TLS.mkdir(parents=True)
    store = ["-keystore", str(KAFKA_KEYSTORE), "-storepass", KEYSTORE_PASSWORD]
    run(
        ["keytool", "-genkeypair", "-alias", "broker", "-keyalg", "RSA", "-keysize", "2048",
         "-validity", "3650", "-dname", "CN=localhost", "-ext", "SAN=ip:127.0.0.1,dns:localhost",
         "-storetype", "PKCS12", "-keypass", KEYSTORE_PASSWORD, *store],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    run(
        ["keytool", "-exportcert", "-alias", "broker", "-rfc", "-file", str(KAFKA_CA), *store],
        stdout=subprocess.DEVNULL,
    )


def kafka_properties() -> str:
    return "\n".join(
        [
            "process.roles=broker,controller",
            "node.id=1",
            f"controller.quorum.voters=1@{HOST}:{CONTROLLER_PORT}",
            f"listeners=PLAINTEXT://{HOST}:{KAFKA_PORT},CONTROLLER://{HOST}:{CONTROLLER_PORT},"
            f"SASL_PLAINTEXT://{HOST}:{KAFKA_SASL_PORT},SASL_SSL://{HOST}:{KAFKA_SSL_PORT}",
            f"advertised.listeners=PLAINTEXT://{HOST}:{KAFKA_PORT},"
            f"SASL_PLAINTEXT://{HOST}:{KAFKA_SASL_PORT},SASL_SSL://{HOST}:{KAFKA_SSL_PORT}",
            "controller.listener.names=CONTROLLER",
            "inter.broker.listener.name=PLAINTEXT",
            "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,"
            "SASL_PLAINTEXT:SASL_PLAINTEXT,SASL_SSL:SASL_SSL",
            f"ssl.keystore.location={KAFKA_KEYSTORE}",
            "ssl.keystore.type=PKCS12",
            f"ssl.keystore.password={KEYSTORE_PASSWORD}",
            f"ssl.key.password={KEYSTORE_PASSWORD}",
            # clients log in as SASL_USER there, held to the ACLs a test sets (none: all
            # allowed); the PLAINTEXT listener's clients and the controller are ANONYMOUS,
            # super users, so tests and the other listener never meet an ACL
            "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "super.users=User:ANONYMOUS",
            "allow.everyone.if.no.acl.found=true",
            "sasl.enabled.mechanisms=PLAIN",
            *(
                f"listener.name.{listener}.plain.sasl.jaas.config="
                "org.apache.kafka.common.security.plain.PlainLoginModule required "
                f'user_{SASL_USER}="{SASL_PASSWORD}";'
                for listener in ("sasl_plaintext", "sasl_ssl")
            ),
            f"log.dirs={KAFKA_DATA}",
            "num.partitions=1",
            # One broker: internal topics at replication factor 1, or transactions never start.
            "offsets.topic.replication.factor=1",
            "offsets.topic.num.partitions=5",
            "transaction.state.log.replication.factor=1",
            "transaction.state.log.min.isr=1",
            "transaction.state.log.num.partitions=5",
            "share.coordinator.state.topic.replication.factor=1",
            "share.coordinator.state.topic.min.isr=1",
            "min.insync.replicas=1",
            "group.initial.rebalance.delay.ms=0",
            # Topics are created on purpose (tests, the relay); a typo must not create one.
            "auto.create.topics.enable=false",
            "delete.topic.enable=true",
            "transaction.abort.timed.out.transaction.cleanup.interval.ms=10000",
            "",
        ]
    )


LOG4J2 = """\
status = warn
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {logs}/server.log
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
"""


def kafka_pid() -> int | None:
    """The broker's pid, if its pid file names this stack's running broker: after a reboot or
    a container's restart, the number may be a stranger's, which `down` then killed."""
    try:
        pid = int(KAFKA_PID.read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    props = str(KAFKA_DIR / "server.properties").encode()
    return pid if b"kafka.Kafka" in cmdline and props in cmdline else None


def kafka_answers() -> bool:
    """True once the broker answers a Kafka request, not merely accepts TCP connections."""
    if not port_open(KAFKA_PORT):
        return False
    try:
        from confluent_kafka.admin import AdminClient
    except ImportError:  # before the virtualenv exists a listening port has to do
        return True
    admin = AdminClient({"bootstrap.servers": f"{HOST}:{KAFKA_PORT}"})
    try:
        return bool(admin.list_topics(timeout=2).brokers)
    except Exception:
        return False


def java_cmd(main: str, *args: str, heap: str = "256m") -> list[str]:
    return [
        "java",
        f"-Xmx{heap}",
        "-cp",
        f"{KAFKA_LIBS}/*",
        f"-Dlog4j2.configurationFile={KAFKA_DIR / 'log4j2.properties'}",
        main,
        *args,
    ]


def resume_if_stopped(pid: int | None, name: str) -> None:
    """A process stopped by SIGSTOP (a test pauses the broker mid-commit, and resumes it; one
    killed meanwhile left it stopped): resumed, not waited for as if it were starting."""
    if pid is None:
        return
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return
    if state == "T":
        log(f"{name} was stopped (SIGSTOP): resuming it")
        os.kill(pid, signal.SIGCONT)


def kraft_cluster_id() -> str:
    """A random cluster id that StorageTool's argument parser takes: one that starts with "-"
    (1 in 64 of them) reads as an option, so format failed. Kafka's Uuid.randomUuid redraws
    those too."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def kafka_up() -> None:
    props = KAFKA_DIR / "server.properties"
    starting = kafka_pid()
    resume_if_stopped(starting, "kafka")
    if starting is not None and not kafka_answers():
        # Still starting (an `up` cut short by Ctrl-C, say): waited for, not started twice (the
        # second failed on the first's data, and the first ran on with no pid file to stop it).
        log("kafka is starting: waiting for it")
        wait_until("kafka", kafka_answers, 120, KAFKA_LOGS / "server.log", alive=kafka_pid)
    if kafka_pid() and kafka_answers():
        if props.exists() and props.read_text() == kafka_properties():
            log(f"kafka already running on {HOST}:{KAFKA_PORT}")
            return
        # started by an older checkout (e.g. before the SASL listener): the tests need these
        log("kafka runs with other settings than this checkout's: restarting it")
        kafka_down()
    if port_open(KAFKA_PORT):
        fail(f"port {KAFKA_PORT} is taken by another process; set OUTBOX_KAFKA_PORT")
    if not shutil.which("java"):
        fail("Java 17+ is needed to run the Kafka broker")
    kafka_jars()
    for port, setting in (
        (CONTROLLER_PORT, "CONTROLLER_PORT"),
        (KAFKA_SASL_PORT, "SASL_PORT"),
        (KAFKA_SSL_PORT, "SSL_PORT"),
    ):
        if port_open(port):
            fail(f"port {port} is taken by another process; set OUTBOX_KAFKA_{setting}")
    kafka_tls()
    KAFKA_LOGS.mkdir(parents=True, exist_ok=True)
    props.write_text(kafka_properties())
    (KAFKA_DIR / "log4j2.properties").write_text(LOG4J2.format(logs=KAFKA_LOGS))
    if not (KAFKA_DATA / "meta.properties").exists():
        cluster_id = kraft_cluster_id()
        log(f"formatting KRaft storage in {KAFKA_DATA}")
        run(
            java_cmd("kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(props)),
            stdout=subprocess.DEVNULL,
        )
    out = (KAFKA_LOGS / "stdout.log").open("ab")
    proc = subprocess.Popen(
        java_cmd("kafka.Kafka", str(props), heap="1g"),
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # outlives this script and the test session that started it
    )
    KAFKA_PID.write_text(str(proc.pid))
    wait_until(
        "kafka",
        kafka_answers,
        120,
        lambda: KAFKA_LOGS / "server.log" if proc.poll() is None else KAFKA_LOGS / "stdout.log",
        alive=lambda: proc.poll() is None,
    )
    log(f"kafka ready on {HOST}:{KAFKA_PORT} (logs: {KAFKA_LOGS})")


def kafka_down() -> None:
    pid = kafka_pid()
    if pid is None:
        return
    terminate(pid, kafka_pid, 60)
    KAFKA_PID.unlink(missing_ok=True)
    log("kafka stopped")


def kafka_kill() -> None:
    """SIGKILL the broker, as a crash: no controlled shutdown, its logs recovered at start."""
    pid = kafka_pid()
    if pid is None:
        return
    os.kill(pid, signal.SIGKILL)
    # the closed port tells it is gone: a killed broker nobody reaps still answers kill(pid, 0)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and port_open(KAFKA_PORT):
        time.sleep(0.1)
    KAFKA_PID.unlink(missing_ok=True)
    log("kafka killed")


# --- Spark connector jars ---------------------------------------------------------------------


def pyspark_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("pyspark")
    except Exception:
        return None


def spark_jars() -> list[Path]:
    """The spark-sql-kafka connector for the installed PySpark, and the PostgreSQL JDBC driver."""
    spark_version = pyspark_version()
    if spark_version is None:
        return []
    dest = SPARK_JARS / spark_version
    # the POM it was resolved from, as for Kafka's: a changed POM (a driver's version) resolves anew
    pom = JVM_POMS / "spark" / "pom.xml"
    stamp = dest / ".complete"
    if not (stamp.exists() and stamp.read_text() == pom.read_text()):
        mvn_copy(pom, dest, f"-Dspark.version={spark_version}")
        stamp.write_text(pom.read_text())
    return sorted(dest.glob("*.jar"))


HELM_VERSION = "v3.16.4"
# The Prometheus module whose cmd/promtool checks and unit-tests the chart's alert rules
# (Prometheus 3's module versions are v0.3xx: v0.316.0 is Prometheus 3.16)
PROMETHEUS_VERSION = "v0.316.0"


@contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Held while `name` is built (helm, the API server, the images) or installed (apt-get): a
    second caller (the tests, while a build `make test` starts in the background runs) waits for
    the first instead of doing it too."""
    (LOCAL / "bin").mkdir(parents=True, exist_ok=True)
    with (LOCAL / "bin" / f".{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def go_tool(name: str, package: str, version: str, takes: str) -> Path:
    """`name` on the PATH, else built once with `go install package@version` into .local/bin."""
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    built = LOCAL / "bin" / name
    with build_lock(name):
        if not built.exists():
            go = shutil.which("go")
            if go is None:
                fail(f"{name}: neither {name} nor a Go toolchain (to build it) is on the PATH")
            log(f"building {name} {version} with go install ({takes}, once)")
            run(
                [go, "install", f"{package}@{version}"],
                env={**os.environ, "GOBIN": str(built.parent)},
            )
    return built


def helm_bin() -> Path:
    return go_tool("helm", "helm.sh/helm/v3/cmd/helm", HELM_VERSION, "a minute or two")


def promtool_bin() -> Path:
    return go_tool(
        "promtool",
        "github.com/prometheus/prometheus/cmd/promtool",
        PROMETHEUS_VERSION,
        "several minutes: Prometheus's service discoveries come with it",
    )


# --- commands ---------------------------------------------------------------------------------


def env_lines() -> list[str]:
    jars = ",".join(str(p) for p in spark_jars())
    return [
        f"OUTBOX_TEST_PG_DSN=postgresql://postgres@{HOST}:{PG_PORT}/postgres",
        f"OUTBOX_TEST_KAFKA_BOOTSTRAP={HOST}:{KAFKA_PORT}",
        # the SASL listener and its login, as a URL: user:password@host:port
        f"OUTBOX_TEST_KAFKA_SASL=sasl://{SASL_USER}:{SASL_PASSWORD}@{HOST}:{KAFKA_SASL_PORT}",
        # the same login over TLS, and the certificate to trust
        f"OUTBOX_TEST_KAFKA_SASL_SSL=sasl://{SASL_USER}:{SASL_PASSWORD}@{HOST}:{KAFKA_SSL_PORT}"
        f"?ca={KAFKA_CA}",
        f"OUTBOX_SPARK_JARS={jars}",
        # a PgBouncer in transaction pooling before that Postgres, if one runs: host:port
        *([f"OUTBOX_TEST_PGBOUNCER={HOST}:{PGBOUNCER_PORT}"] if pgbouncer_pid() else []),
    ]


def up() -> None:
    reserve_ports(
        PG_PORT, PGBOUNCER_PORT, KAFKA_PORT, CONTROLLER_PORT, KAFKA_SASL_PORT, KAFKA_SSL_PORT
    )
    heal()  # a run stopped mid-partition left the stack, or a test's Postgres, cut off
    stop_failover_clusters()
    postgres_up()
    pgbouncer_up()
    # The failover tests cut a Postgres off the network with it, as a failed node is.
    if debian_tool("iptables", "iptables", "iptables"):
        log("iptables ready (the failover tests drop a test Postgres's packets with it)")
    kafka_up()
    jars = spark_jars()
    if jars:
        log(f"spark connector jars ready ({len(jars)} jars in {jars[0].parent})")
    else:
        log("pyspark is not installed here: skipped the Spark connector jars")


def status() -> int:
    bindir = pg_bindir()
    pg = bool(bindir) and pg_running() and pg_ready(bindir)  # type: ignore[arg-type]
    kafka = kafka_pid() is not None and kafka_answers()
    print(f"postgres  {'up' if pg else 'down':4}  {HOST}:{PG_PORT}  log {PG_LOG}")
    bouncer = pgbouncer_pid() is not None and port_open(PGBOUNCER_PORT)
    print(
        f"pgbouncer {'up' if bouncer else 'down':4}  {HOST}:{PGBOUNCER_PORT}  log {PGBOUNCER_LOG}"
    )
    print(
        f"kafka     {'up' if kafka else 'down':4}  {HOST}:{KAFKA_PORT} (SASL PLAIN "
        f"{KAFKA_SASL_PORT}, over TLS {KAFKA_SSL_PORT})  logs {KAFKA_LOGS}"
    )
    return 0 if pg and kafka else 1


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "help"
    if cmd in ("up", "down", "restart", "crash"):
        # One at a time: two `up`s at once (a `make run` beside `make test`) started a second
        # broker over the first's data, or raced initdb.
        with build_lock("services"):
            return _change(cmd, argv)
    return _inspect(cmd, argv)


def _change(cmd: str, argv: list[str]) -> int:
    if cmd == "up":
        up()
        for line in env_lines():
            print(line)
        return 0
    if cmd == "down":
        import kube  # type: ignore[import-not-found]  # scripts/kube.py, the chart tests' API server

        kube.down()
        kafka_down()
        pgbouncer_down()
        postgres_down()
        heal()  # a partition left behind would outlive them
        stop_failover_clusters()
        return 0
    if cmd == "restart" and len(argv) == 3 and argv[2] in ("postgres", "kafka"):
        # For fault tests: the same data, a new process.
        if argv[2] == "postgres":
            postgres_down()
            postgres_up()
        else:
            kafka_down()
            kafka_up()
        return 0
    if cmd == "crash" and len(argv) == 3 and argv[2] in ("postgres", "kafka"):
        # For fault tests: stopped as a crash stops it; `up` starts it again on the same data.
        if argv[2] == "postgres":
            postgres_down("immediate")
        else:
            kafka_kill()
        return 0
    print(__doc__)
    return 2


def _inspect(cmd: str, argv: list[str]) -> int:
    if cmd == "status":
        return status()
    if cmd in ("partition", "heal") and len(argv) == 3 and argv[2] in ("postgres", "kafka"):
        # For fault tests: the service runs on, unreachable (its clients' packets dropped).
        port = PG_PORT if argv[2] == "postgres" else KAFKA_PORT
        if cmd == "heal":
            heal(port)
        elif not partition(port):
            fail("cannot drop packets here: it needs root and iptables (`up` installs it)")
        return 0
    if cmd == "spark-jars":  # only the jars, for machines whose services come from elsewhere
        print(next(line for line in env_lines() if line.startswith("OUTBOX_SPARK_JARS=")))
        return 0
    if cmd == "helm":
        print(helm_bin())
        return 0
    if cmd == "promtool":
        print(promtool_bin())
        return 0
    if cmd == "env":
        for line in env_lines():
            print(f"export {line}")
        return 0
    print(__doc__)
    return 0 if cmd in ("help", "-h", "--help") else 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
