"""The checker service: asks producers about stale prepared transactions (RocketMQ's check-back).

One round (``run_once``, which tests call directly):

1. claim, in one short database transaction: lock due transactions (``FOR UPDATE SKIP LOCKED``),
   then for each one either
   - discard it (``max_checks`` checks made, or older than ``max_prepared_age``): the relay ships
     it to the dead-letter topic;
   - reschedule it without asking and without counting a check (no endpoint configured for its
     producer group; its endpoint's circuit is open);
   - or claim it: count the check and lease it (``next_check_at`` = end of the lease), so that
     a checker dying mid-check leaves it due again when the lease ends, and other checkers do not
     ask about it meanwhile. A check whose lease ran out with no outcome recorded was lost (the
     checker killed, or cut from the database): it is given back, not counted, so that a lost
     last check does not discard a transaction its endpoint would have committed;
2. ask each claimed transaction's endpoint, outside any database transaction, on that endpoint's
   own worker threads (bounded concurrency, circuit breaker, timeouts): a dead endpoint only
   holds its own workers;
3. apply each answer as it arrives: COMMIT / ROLLBACK through the library's compare-and-set
   (``end_transaction``, which NOTIFYs the relay on commit); UNKNOWN or no usable answer: the next
   check after a jittered exponential backoff (compare-and-set on the claimed check count).

The checker only changes the database; everything that reaches Kafka is the relay's.
``start()`` runs rounds on a thread until ``stop()``; several checkers may share one outbox.
"""

from __future__ import annotations

import functools
import logging
import os
import queue
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from types import TracebackType
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors as pg_errors

from checker import _claim, _metrics
from checker._backoff import backoff, spread
from checker._breaker import CircuitBreaker, CircuitState
from checker._claim import Claim, DueTransaction, Reschedule
from checker._client import CheckAnswer, CheckClient, HttpCheckClient, Outcome
from checker.config import CheckerSettings, EndpointSettings
from outbox import sql as queries
from outbox._core import OutboxConfig, wakeup_channel
from outbox._dsn import parse_dsn
from outbox._errors import (
    IllegalTransitionError,
    InvalidRecordError,
    OutboxDatabaseError,
    UnknownTransactionError,
)
from outbox._sync import Outbox
from outbox.migrations import CHECKER_SCHEMA_VERSION, schema_problem
from relay.dbconnect import (
    CHECKER_IDLE_TRANSACTION,
    bound_idle_time,
    dead_peer_options,
    own_transaction_mode,
)
from relay.dbprobe import DatabaseProbe
from relay.http import CHECK_WITHIN_S, InFlight, gather

if TYPE_CHECKING:
    from relay.config import SidecarSettings

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]
ClientFactory = Callable[[str, EndpointSettings], CheckClient]

_MAX_FAILURE_WAIT_S = 30.0
ROUND_ALLOWANCE_S = 120.0  # how long a round may take before the liveness probe calls it stuck
_MAX_LOGGED_GROUPS = 1000
_MAX_APPLY_BATCH = 256
_AGES_STATEMENT_TIMEOUT = "5s"
# How long a round's answers wait, all told, for rows an application holds: each waiting its
# own 2 s, one after the other on the round's thread, answers queued behind them outlived their
# leases (asked again by another checker) when an application held many.
APPLY_LOCK_WAIT_S = 2.0
# Answers this checker dropped for rows an application held, kept to tell their lapsed leases
# from lost checks; forgotten past this many (a lapse then said lost: a label, not a count)
_MAX_REMEMBERED_DROPS = 10_000


_Note = tuple[Callable[..., None], tuple[Any, ...]]  # a log call to make once committed
# how to log an UNKNOWN or failed check, and what once its outcome is recorded, or not
_CheckNote = tuple[Callable[..., None], tuple[Any, ...], tuple[Any, ...]]
# an UNKNOWN or failed check whose reschedule did not apply: rows an application holds (it ends
# the transaction), the transaction claimed again after the lease ran out, or ended meanwhile
_NOT_RECORDED = (
    "tx %s of producer group %s: %s%s (check %d of %d), not recorded: the transaction was being "
    "ended, or was claimed again after its check lease ran out"
)


class _AnswerTrouble(Exception):
    """An answer of a batch cannot be applied as it is: the batch goes again, one by one."""


# Rows another transaction holds: past lock_timeout, or in a deadlock Postgres broke by
# ending the checker's wait (an application's transaction ending one tx, then wanting another).
_HELD = (pg_errors.LockNotAvailable, pg_errors.DeadlockDetected)


def _locked(exc: BaseException) -> bool:
    """The library's database error for rows another transaction holds."""
    return isinstance(exc.__cause__, _HELD)


def _connection_suspect(exc: BaseException) -> bool:
    """A database error a round failed on, other than rows held: the connection is replaced.
    Kept while psycopg did not call it broken, one reconnected after a failover to a node still
    read-only (a proxy's old route, a DSN without target_session_attrs) failed every round
    until the checker was restarted, its probes green."""
    cause = exc if isinstance(exc, psycopg.Error) else exc.__cause__
    return isinstance(cause, psycopg.Error) and not isinstance(cause, _HELD)


@contextmanager
def _waiting_for_rows(
    conn: psycopg.Connection[Any], wait_s: float = APPLY_LOCK_WAIT_S
) -> Iterator[None]:
    """A transaction that waits a little (`wait_s`) for rows an application holds, not for as
    long as the application likes (it ends the transaction itself and keeps its own open)."""
    with conn.transaction():
        conn.execute(
            "SELECT set_config('lock_timeout', %s, true),"
            " set_config('statement_timeout', '0', true)",  # as in the claim
            (f"{max(1, round(wait_s * 1000))}ms",),  # 0 would be no timeout at all
        )
        yield
        # not at the commit: its wake-up notification queues for a lock of its own
        conn.execute("SELECT set_config('lock_timeout', '0', true)")


def utc_now() -> datetime:
    return datetime.now(UTC)


def _duration(value: timedelta) -> str:
    """72h, 90m, 45s: how limits read in reasons and logs."""
    seconds = int(value.total_seconds())
    for unit, size in (("d", 86_400), ("h", 3_600), ("m", 60)):
        if seconds >= size and seconds % size == 0 and not (unit == "d" and seconds < 7 * 86_400):
            return f"{seconds // size}{unit}"
    return f"{value.total_seconds():g}s"


@dataclass
class CheckRoundResult:
    """What one round did. ``outcomes`` counts the checks made, by ``Outcome`` value."""

    due: int = 0  # due transactions found and locked
    checked: int = 0  # requests sent
    outcomes: Counter[str] = field(default_factory=Counter)
    discarded: int = 0
    not_sent: int = 0  # rescheduled without a request: no endpoint, circuit open, deferred
    conflicts: int = 0  # COMMIT / ROLLBACK for a transaction that had ended otherwise
    full: bool = False  # a full batch was due: more may be waiting

    @property
    def committed(self) -> int:
        return self.outcomes[Outcome.COMMIT.value]

    @property
    def rolled_back(self) -> int:
        return self.outcomes[Outcome.ROLLBACK.value]

    @property
    def unknown(self) -> int:
        return self.outcomes[Outcome.UNKNOWN.value]

    @property
    def failed(self) -> int:
        return self.checked - self.committed - self.rolled_back - self.unknown

    def as_dict(self) -> dict[str, Any]:
        return {
            "due": self.due,
            "checked": self.checked,
            "outcomes": dict(self.outcomes),
            "discarded": self.discarded,
            "not_sent": self.not_sent,
            "conflicts": self.conflicts,
            "full": self.full,
        }


class _Endpoint:
    """A producer group's endpoint: its client, circuit breaker and worker threads."""

    def __init__(
        self, group: str, settings: EndpointSettings, client: CheckClient, breaker: CircuitBreaker
    ) -> None:
        self.group = group
        self.settings = settings
        self.client = client
        self.breaker = breaker
        self.pool = ThreadPoolExecutor(
            max_workers=settings.concurrency, thread_name_prefix=f"outbox-checker-{group}"[:40]
        )


class Checker:
    """Checks stale prepared transactions against their producer group's endpoint.

    ``clock`` gives the time the checker schedules by (aware datetimes; tests move it instead of
    sleeping); signatures always use the real time. ``rng`` jitters the waits. ``http`` builds the
    client of each endpoint (``HttpCheckClient`` by default).
    """

    def __init__(
        self,
        settings: CheckerSettings,
        dsn: str,
        schema: str = "outbox",
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        http: ClientFactory | None = None,
        connect_timeout_s: float = 10.0,
        connect_options: Mapping[str, Any] | None = None,
        checker_id: str | None = None,
        follow_database_clock: bool | None = None,
        idle_transaction_timeout: timedelta | None = None,
    ) -> None:
        self.settings = settings
        # dbconnect.bound_idle_time: None through a transaction pooler (session state)
        self._idle_transaction_timeout = idle_transaction_timeout
        self.schema = OutboxConfig(schema_name=schema).schema_name
        parse_dsn(dsn)  # a round's error would quote what libpq cannot parse: a password
        self.checker_id = checker_id or f"{socket.gethostname()}-{os.getpid()}"
        self._dsn = dsn
        self._connect_timeout_s = connect_timeout_s
        # psycopg.connect's, beyond the DSN (DatabaseSettings.connect_options: a pooler's needs)
        self._connect_options = dict(connect_options or {})
        self._db_probe = DatabaseProbe(
            self._connect, wait_s=connect_timeout_s, owner="the checker's"
        )
        self._ready_checks = InFlight()  # /readyz's check still running
        self._clock = clock or utc_now
        # Scheduled by the database's clock: created_at and the other checkers' leases are its
        # times. By this host's, a host 6 s ahead cut the check immunity by 6 s, and two hosts
        # more than a lease apart asked about one transaction at once. Measured each round;
        # a clock given (tests) is taken as it is unless asked.
        if follow_database_clock is None:
            follow_database_clock = clock is None
        self._follow_database = follow_database_clock
        self._skew = timedelta(0)  # the database's clock minus this host's
        self._rng = rng or random.Random()  # noqa: S311 - jitter, not secrets
        self._rng_lock = threading.Lock()
        self._outbox = Outbox(OutboxConfig(schema_name=self.schema, notify=True))
        self._channel = wakeup_channel(self.schema)
        make_client = http or (lambda _group, endpoint: HttpCheckClient(endpoint))
        # by case-folded name: environment variables and secret files carry no case, so a
        # producer group matches its endpoint whatever the case (the settings fold the names)
        self._endpoints: dict[str, _Endpoint] = {}
        for group, endpoint in settings.endpoints.items():
            self._endpoints[group.casefold()] = _Endpoint(
                group,
                endpoint,
                make_client(group, endpoint),
                CircuitBreaker(
                    failure_threshold=settings.circuit_failure_threshold,
                    cooldown=settings.circuit_cooldown,
                    clock=self._now,
                    on_change=self._circuit_changed(group),
                ),
            )
            _metrics.CIRCUIT_STATE.labels(group).set(CircuitState.CLOSED)
        # At 0 from the start: increase() does not see a discard whose series first shows at 1,
        # and a first discard since the start is the usual one
        for label in (*settings.endpoints, _metrics.OTHER_GROUP):
            for limit in _metrics.DISCARD_LIMITS:
                _metrics.DISCARDS.labels(label, limit)
        for result in ("ok", "error"):  # and the first failed round (OutboxCheckerFailing)
            _metrics.ROUNDS.labels(result)
        self._conn: psycopg.Connection[Any] | None = None
        self._round_lock = threading.Lock()
        self._lock_wait_left_s = APPLY_LOCK_WAIT_S  # what a round's answers may yet wait
        # (group, tx id) -> the claimed check count and first record time of the transaction
        # whose answer was dropped for held rows (the time tells a tx id used again apart)
        self._dropped_for_held_rows: dict[tuple[str, str], tuple[int, datetime | None]] = {}
        self._unconfigured_logged: set[str] = set()
        self._ages_refreshed_at: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._last_round_ok = False
        self._last_round_at = time.monotonic()

    @classmethod
    def from_sidecar_settings(cls, settings: SidecarSettings, **kwargs: Any) -> Checker:
        """The checker of the sidecar process, from its settings."""
        return cls(
            settings.checker,
            settings.database.dsn.get_secret_value(),
            settings.database.schema_name,
            connect_timeout_s=settings.database.connect_timeout_s,
            connect_options=settings.database.connect_options(),
            idle_transaction_timeout=(
                None if settings.database.transaction_pooling else CHECKER_IDLE_TRANSACTION
            ),
            **kwargs,
        )

    # --- database ----------------------------------------------------------------------------

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = self._connect()
        return self._conn

    def _connect(self, **options: Any) -> psycopg.Connection[Any]:
        conn = psycopg.connect(
            self._dsn,
            autocommit=True,
            connect_timeout=max(1, int(self._connect_timeout_s)),
            application_name=f"outbox-checker {self.checker_id}"[:63],
            **{
                **dead_peer_options(self._dsn, self._connect_timeout_s),
                **self._connect_options,
                **options,
            },
        )
        own_transaction_mode(conn)  # its claims and verdicts: in transaction blocks
        if self._idle_transaction_timeout is None:
            return conn
        return bound_idle_time(conn, self._idle_transaction_timeout, self._connect_timeout_s)

    def _now(self) -> datetime:
        return self._clock() + self._skew

    def _follow(self, conn: psycopg.Connection[Any]) -> None:
        """Measure how far the database's clock is from this host's (see __init__)."""
        if not self._follow_database:
            return
        before = self._clock()
        row = conn.execute("SELECT clock_timestamp()").fetchone()
        after = self._clock()
        if row is not None:
            self._skew = row[0] - (before + (after - before) / 2)

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # --- one round ---------------------------------------------------------------------------

    def run_once(self) -> CheckRoundResult:
        """One round: claim due transactions, ask their endpoints, apply the answers."""
        with self._round_lock:
            if self._closed:
                raise RuntimeError("the checker is stopped")
            try:
                conn = self._connection()
                self._follow(conn)
                result = CheckRoundResult()
                self._refresh_ages(conn)
                claims = self._claim_due(conn, result)
                self._ask_and_apply(conn, claims, result)
            except BaseException as exc:
                _metrics.ROUNDS.labels("error").inc()
                self._last_round_ok = False
                self._last_round_at = time.monotonic()
                if self._conn is not None and (
                    self._conn.broken or self._conn.closed or _connection_suspect(exc)
                ):
                    self._drop_connection()
                raise
            _metrics.ROUNDS.labels("ok").inc()
            self._last_round_ok = True
            self._last_round_at = time.monotonic()
            return result

    def _claim_due(self, conn: psycopg.Connection[Any], result: CheckRoundResult) -> list[Claim]:
        s = self.settings
        now = self._now()
        discards: list[tuple[str, str, str]] = []
        limits: dict[tuple[str, str], tuple[str, str]] = {}  # -> (limit, reason)
        later: list[Reschedule] = []
        claims: list[Claim] = []
        probing: set[str] = set()
        # Logs and metrics of what the claim decides, said once it is committed: a commit that
        # failed (a failover) said transactions were discarded that were still prepared, and
        # counted them again the round after.
        committed: list[Callable[[], None]] = []
        seen: list[tuple[str, str]] = []  # their answers dropped for held rows: told now
        with conn.transaction():
            # A transaction of many records takes its time to lock (a role's or database's
            # statement_timeout failed every round, the discards in it too), as the relay's claim
            conn.execute(queries.query("checker_statement_timeout", self.schema), {"timeout": "0"})
            due, scan_full = _claim.lock_due(
                conn,
                self.schema,
                now=now,
                limit=s.batch_size,
                default_immunity=s.check_immunity,
                max_age=s.max_prepared_age,
            )
            more_due = len(due) >= s.batch_size or scan_full
            for tx in due:
                if tx.held_elsewhere:
                    continue
                result.due += 1
                key = (tx.producer_group, tx.tx_id)
                dropped = self._dropped_for_held_rows.get(key)
                seen.append(key)
                if tx.check_lost:
                    committed.append(functools.partial(self._said_lost, tx, dropped))
                if tx.checks_made >= s.max_checks:
                    limits[key] = ("max_checks", f"max checks ({s.max_checks}) reached")
                elif now - tx.age_from >= s.max_prepared_age:
                    age = _duration(s.max_prepared_age)
                    # said apart: its local transaction may have committed, and nobody asked
                    unasked = "" if tx.checks_made else " with no check made"
                    limits[key] = ("max_age", f"max prepared age ({age}) reached{unasked}")
                if key in limits:
                    discards.append((*key, limits[key][1]))
                    continue
                if tx.mixed:
                    logger.warning(
                        "tx %s of producer group %s has %d prepared and %d other records: it "
                        "cannot be checked (resolve it by hand); discarded at max prepared age",
                        tx.tx_id,
                        tx.producer_group,
                        tx.prepared,
                        tx.records - tx.prepared,
                    )
                    later.append(self._later(tx, now + self._spread(s.max_backoff)))
                    _metrics.NOT_SENT.labels(self._label(tx.producer_group), "mixed_states").inc()
                    continue
                endpoint = self._endpoint(tx.producer_group)
                if endpoint is None:
                    self._note_unconfigured(tx.producer_group)
                    # Leave it, out of the way of the others; discarded at max age all the same.
                    later.append(self._later(tx, now + self._spread(s.max_backoff)))
                    continue
                state = endpoint.breaker.state
                if state is CircuitState.OPEN:
                    # Not asked, not counted: due again when a probe may go out.
                    later.append(self._later(tx, endpoint.breaker.retry_at or now))
                    _metrics.NOT_SENT.labels(endpoint.group, "circuit_open").inc()
                    continue
                if state is CircuitState.HALF_OPEN:
                    # by endpoint: groups that differ by case share one, and its one probe
                    if endpoint.group in probing:
                        if tx.check_lost:  # given back now: else logged and counted lost again
                            later.append(self._later(tx, now))
                        continue  # one probe at a time; the rest stay due
                    probing.add(endpoint.group)
                lease = endpoint.settings.timeout + s.lease_margin
                claims.append(
                    Claim(
                        tx.producer_group,
                        tx.tx_id,
                        tx.checks_made + 1,
                        tx.first_created_at,
                        claimed_at=now,
                        lease_until=now + lease,
                        send_by=now + s.lease_margin,
                        discard_at=tx.age_from + s.max_prepared_age,
                        record_count=tx.records,
                    )
                )
            # Go again at once only if this round moved something: transactions other
            # processes hold stay due, and would make the checker spin on them.
            result.full = more_due and result.due > 0
            if discards:
                done = _claim.discard(conn, self.schema, discards, actor=self._actor)
                for group, tx_id in done:
                    limit, reason = limits[(group, tx_id)]
                    committed.append(functools.partial(self._said_discarded, group, tx_id,
                                                       limit, reason))  # fmt: skip
                result.discarded = len(done)
                if done:
                    _claim.wake_relay(conn, self.schema, self._channel)
            if later:
                _claim.reschedule(conn, self.schema, later)
                result.not_sent += len(later)
            claimed = _claim.claim(
                conn, self.schema, claims, now=now, max_records=s.request_max_records
            )
            if result.discarded:
                # The last statement: the commit notifies the relays, and waits for Postgres's
                # notify lock, which the applications' notifying commits take one after another:
                # a role's lock_timeout failed it, the whole claim with it, every round while
                # they were busy (as in _waiting_for_rows and the manual actions).
                conn.execute("SELECT set_config('lock_timeout', '0', true)")
        for key in seen:
            self._dropped_for_held_rows.pop(key, None)
        for said in committed:
            said()
        return claimed

    def _said_lost(self, tx: DueTransaction, dropped: tuple[int, datetime | None] | None) -> None:
        """A lost check given back (committed): logged and counted."""
        if dropped == (tx.check_count, tx.first_created_at):
            # Its application held the rows and then did not end it (rolled back): not a lost
            # check, which blames a checker killed or cut off.
            logger.info(
                "tx %s of producer group %s: check %d's outcome was not recorded while its "
                "application held its rows, and it is still prepared; not counted",
                tx.tx_id,
                tx.producer_group,
                tx.check_count,
            )
            return
        logger.warning(
            "tx %s of producer group %s: check %d was lost (its lease ran out with no outcome "
            "recorded: a checker killed or cut from the database, or one whose answer came "
            "after the lease); not counted",
            tx.tx_id,
            tx.producer_group,
            tx.check_count,
        )
        _metrics.LOST.labels(self._label(tx.producer_group)).inc()

    def _said_discarded(self, group: str, tx_id: str, limit: str, reason: str) -> None:
        _metrics.DISCARDS.labels(self._label(group), limit).inc()
        logger.warning("discarded tx %s of producer group %s: %s", tx_id, group, reason)

    @property
    def _actor(self) -> str:
        return f"checker:{self.checker_id}"

    def _later(self, tx: DueTransaction, at: datetime) -> Reschedule:
        """Due again at `at`, or at its maximum prepared age if that comes first: a later due
        time put off its discard (by up to max_backoff for a group without an endpoint)."""
        at = min(at, tx.age_from + self.settings.max_prepared_age)
        return Reschedule(tx.producer_group, tx.tx_id, tx.check_count, tx.checks_made, at)

    def _spread(self, delay: timedelta) -> timedelta:
        with self._rng_lock:
            return spread(delay, self.settings.backoff_jitter, self._rng)

    def _endpoint(self, group: str) -> _Endpoint | None:
        return self._endpoints.get(group.casefold())

    def _label(self, group: str) -> str:
        """The metrics label of a producer group: its endpoint's name, or ``other``."""
        endpoint = self._endpoint(group)
        return endpoint.group if endpoint is not None else _metrics.OTHER_GROUP

    def _note_unconfigured(self, group: str) -> None:
        _metrics.NOT_SENT.labels(_metrics.OTHER_GROUP, "no_endpoint").inc()
        if group in self._unconfigured_logged or len(self._unconfigured_logged) >= (
            _MAX_LOGGED_GROUPS
        ):
            return
        self._unconfigured_logged.add(group)
        logger.error(
            "prepared transactions of producer group %s cannot be checked: no endpoint is "
            "configured for it (checker.endpoints); they are discarded at max prepared age",
            group,
        )

    def _ask(self, endpoint: _Endpoint, claim: Claim) -> tuple[Claim, CheckAnswer]:
        """On the endpoint's worker thread: one request, unless it is too late or the circuit is
        open. Exceptions other than ``Exception`` (a simulated crash) propagate to the round."""
        if self._now() > claim.send_by:
            return claim, CheckAnswer(Outcome.DEFERRED, "could not start within the lease")
        if self._stop.is_set():  # each would take up to its timeout, past the stop's grace
            return claim, CheckAnswer(Outcome.DEFERRED, "the checker is stopping")
        permit = endpoint.breaker.allow()
        if permit is None:
            return claim, CheckAnswer(Outcome.CIRCUIT_OPEN, "circuit open")
        try:
            answer = endpoint.client.check(claim.request(self.settings.request_max_bytes))
        except Exception as exc:
            logger.exception(
                "check of tx %s of producer group %s at %s failed unexpectedly",
                claim.tx_id,
                claim.producer_group,
                endpoint.settings.shown_url,
            )
            answer = CheckAnswer(Outcome.INTERNAL_ERROR, f"{type(exc).__name__}: {exc}")
        if answer.outcome.answered:
            endpoint.breaker.record_success()
        elif answer.outcome.sent:
            endpoint.breaker.record_failure(permit)
        return claim, answer

    def _ask_and_apply(
        self, conn: psycopg.Connection[Any], claims: list[Claim], result: CheckRoundResult
    ) -> None:
        """Ask on the endpoints' workers; apply answers as they arrive, those that arrived
        together in one database transaction (one WAL flush for many, not one each)."""
        if not claims:
            return
        self._lock_wait_left_s = APPLY_LOCK_WAIT_S  # this round's, all told
        arrived: queue.SimpleQueue[Future[tuple[Claim, CheckAnswer]]] = queue.SimpleQueue()
        for c in claims:
            endpoint = self._endpoints[c.producer_group.casefold()]
            endpoint.pool.submit(self._ask, endpoint, c).add_done_callback(arrived.put)
        left = len(claims)
        while left:
            batch = [arrived.get()]
            while len(batch) < _MAX_APPLY_BATCH:
                try:
                    batch.append(arrived.get_nowait())
                except queue.Empty:
                    break
            left -= len(batch)
            # A crash of the round (BaseException) propagates here: nothing more is applied.
            self._apply(conn, [f.result() for f in batch], result)

    def _apply(
        self,
        conn: psycopg.Connection[Any],
        answers: list[tuple[Claim, CheckAnswer]],
        result: CheckRoundResult,
    ) -> None:
        s = self.settings
        now = self._now()
        decided: list[tuple[Claim, Outcome]] = []
        later: list[Reschedule] = []
        notes: dict[tuple[str, str], _CheckNote] = {}  # by (group, tx id)
        for claim, answer in answers:
            group, tx_id, outcome = claim.producer_group, claim.tx_id, answer.outcome
            if answer.latency_s is not None:
                _metrics.LATENCY.labels(self._label(group)).observe(answer.latency_s)
            if not outcome.sent:
                # Never asked: give the check back, and try again when it can go out.
                _metrics.NOT_SENT.labels(self._label(group), outcome.value).inc()
                retry_at = self._endpoints[group.casefold()].breaker.retry_at or now
                count = claim.check_count
                later.append(
                    Reschedule(
                        group,
                        tx_id,
                        count,
                        count - 1,
                        min(retry_at, claim.discard_at),
                        expected_lease=claim.lease_until,
                        first_created_at=claim.first_created_at,
                    )
                )
                result.not_sent += 1
                continue
            _metrics.CHECKS.labels(self._label(group), outcome.value).inc()
            result.checked += 1
            result.outcomes[outcome.value] += 1
            if outcome.decided:
                decided.append((claim, outcome))
                continue
            with self._rng_lock:
                wait = backoff(
                    claim.check_count,
                    interval=s.check_interval,
                    multiplier=s.backoff_multiplier,
                    cap=s.max_backoff,
                    jitter=s.backoff_jitter,
                    rng=self._rng,
                )
            count = claim.check_count
            next_at = min(now + wait, claim.discard_at)
            later.append(
                Reschedule(
                    group,
                    tx_id,
                    count,
                    count,
                    next_at,
                    expected_lease=claim.lease_until,
                    first_created_at=claim.first_created_at,
                )
            )
            said = (
                tx_id,
                group,
                outcome.value,
                f": {answer.detail}" if answer.detail else "",
                count,
                s.max_checks,
            )
            message = "tx %s of producer group %s: %s%s (check %d of %d); " + (
                "next check in %.0fs"
                if count < s.max_checks
                else "no check is left: discarded in %.0fs unless it is ended first"
            )
            notes[(group, tx_id)] = (
                logger.info if outcome is Outcome.UNKNOWN else logger.warning,
                # the backoff, or less to the discard
                (message, *said, (next_at - now).total_seconds()),
                (_NOT_RECORDED, *said),
            )

        def ended(note: _Note, conflicted: bool, group: str) -> None:  # once committed
            if conflicted:
                result.conflicts += 1
                _metrics.CONFLICTS.labels(self._label(group)).inc()
            log, args = note
            log(*args)

        def recorded(key: tuple[str, str], done: bool) -> None:  # once committed, if done
            if key in notes:  # else a check never sent, given back
                log, if_done, if_not = notes[key]
                log(*(if_done if done else if_not))

        # Answers that arrived together go in one transaction (one WAL flush). An answer in
        # trouble (rows an application holds, rows the library refuses) would undo the others:
        # then each goes again in a transaction of its own, which costs a WAL flush each.
        try:
            applied, rescheduled = self._apply_all(conn, decided, later)
        except _AnswerTrouble:
            self._apply_each(conn, decided, later, ended, recorded)
            return
        for note, conflicted, group in applied:
            ended(note, conflicted, group)
        for item in later:
            key = (item.producer_group, item.tx_id)
            recorded(key, key in rescheduled)

    def _apply_all(
        self,
        conn: psycopg.Connection[Any],
        decided: list[tuple[Claim, Outcome]],
        later: list[Reschedule],
    ) -> tuple[list[tuple[_Note, bool, str]], set[tuple[str, str]]]:
        """End the decided transactions and reschedule the others, in one database transaction;
        (what to log, whether the answer came too late, group) of each decided one, and the
        (group, tx id) of those rescheduled."""
        applied: list[tuple[_Note, bool, str]] = []
        with _waiting_for_rows(conn):
            answered = [(c.producer_group, c.tx_id) for c, _ in decided]
            try:  # all or none: it never waits for an application's rows while it holds others'
                _claim.lock_answered(
                    conn, self.schema, answered + [(i.producer_group, i.tx_id) for i in later]
                )
            except _HELD as exc:
                raise _AnswerTrouble from exc
            for claim, outcome in decided:
                try:
                    note, conflicted = self._end(conn, claim, outcome)
                except (OutboxDatabaseError, InvalidRecordError) as exc:
                    if isinstance(exc, InvalidRecordError) or _locked(exc):
                        raise _AnswerTrouble from exc
                    raise
                applied.append((note, conflicted, claim.producer_group))
            try:
                rescheduled = _claim.reschedule(conn, self.schema, later)
            except _HELD as exc:
                raise _AnswerTrouble from exc
        return applied, rescheduled

    def _apply_each(
        self,
        conn: psycopg.Connection[Any],
        decided: list[tuple[Claim, Outcome]],
        later: list[Reschedule],
        ended: Callable[[_Note, bool, str], None],
        recorded: Callable[[tuple[str, str], bool], None],
    ) -> None:
        """Each answer in a transaction of its own: rows held for one do not drop the others',
        and a wait for an application's rows holds no other transaction's. Each is reported
        (`ended`, `recorded`) as it commits: a failure of a later one does not hide it."""
        for claim, outcome in decided:
            ended(*self._apply_one(conn, claim, outcome), claim.producer_group)
        for item in later:
            key = (item.producer_group, item.tx_id)
            recorded(key, key in self._reschedule_one(conn, item))

    @contextmanager
    def _waiting_out_of_the_rounds_budget(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """_waiting_for_rows with what is left of the round's wait, and the time taken (its wait
        for held rows, the rest a statement's few ms) taken off it: a budget of time spent, not
        a deadline, which a slow endpoint's answers, arriving late, would find passed."""
        began = time.monotonic()
        try:
            with _waiting_for_rows(conn, self._lock_wait_left_s):
                yield
        finally:
            spent = time.monotonic() - began
            self._lock_wait_left_s = max(0.0, self._lock_wait_left_s - spent)

    def _reschedule_one(
        self, conn: psycopg.Connection[Any], item: Reschedule
    ) -> set[tuple[str, str]]:
        """One reschedule in a transaction of its own; nothing if its rows are held."""
        try:
            with self._waiting_out_of_the_rounds_budget(conn):
                return _claim.reschedule(conn, self.schema, [item])
        except _HELD:
            self._remember_dropped(
                item.producer_group, item.tx_id, item.expected_count, item.first_created_at
            )
            return set()

    def _remember_dropped(
        self, group: str, tx_id: str, claimed_count: int, first_created_at: datetime | None
    ) -> None:
        if len(self._dropped_for_held_rows) >= _MAX_REMEMBERED_DROPS:
            self._dropped_for_held_rows.clear()
        self._dropped_for_held_rows[(group, tx_id)] = (claimed_count, first_created_at)

    def _apply_one(
        self, conn: psycopg.Connection[Any], claim: Claim, outcome: Outcome
    ) -> tuple[_Note, bool]:
        """One answer, in a transaction of its own: its trouble does not undo the others'."""
        group, tx_id = claim.producer_group, claim.tx_id
        try:
            with self._waiting_out_of_the_rounds_budget(conn):
                return self._end(conn, claim, outcome)
        except OutboxDatabaseError as exc:  # the library wraps psycopg's errors
            if not _locked(exc):
                raise  # the round fails, as for any other database error
            _metrics.NOT_APPLIED.labels(self._label(group), "locked").inc()
            self._remember_dropped(group, tx_id, claim.check_count, claim.first_created_at)
            message = (
                "tx %s of producer group %s: its rows are locked (its application is ending "
                "it); answer %s dropped, the transaction is due again when its lease ends"
            )
            return (logger.info, (message, tx_id, group, outcome.value.upper())), False
        except InvalidRecordError as exc:  # rows another writer stored that the library refuses
            _metrics.NOT_APPLIED.labels(self._label(group), "invalid").inc()
            message = "tx %s of producer group %s: answer %s not applied: %s"
            return (logger.error, (message, tx_id, group, outcome.value.upper(), exc)), False

    def _end(
        self, conn: psycopg.Connection[Any], claim: Claim, outcome: Outcome
    ) -> tuple[_Note, bool]:
        """COMMIT / ROLLBACK through the library's compare-and-set; (what to log once
        committed, whether the answer contradicted an end that came first)."""
        group, tx_id, verdict = claim.producer_group, claim.tx_id, outcome.value.upper()
        end = self._outbox.commit if outcome is Outcome.COMMIT else self._outbox.rollback
        try:
            # The answer is about the transaction asked about: the tx id of one whose records
            # were removed meanwhile may be a later transaction's (README), left alone.
            transition = end(conn, tx_id, producer_group=group, record_ids=claim.record_ids)
        except IllegalTransitionError as exc:
            # A late answer contradicting the transaction's end: the compare-and-set refused it.
            states = ", ".join(exc.current_states)
            message = "endpoint of producer group %s answered %s for tx %s, already %s: ignored"
            return (logger.warning, (message, group, verdict, tx_id, states)), True
        except UnknownTransactionError:
            message = (
                "tx %s of producer group %s is gone (a later transaction of that tx id, if "
                "any, is left alone); answer dropped"
            )
            return (logger.info, (message, tx_id, group)), False
        already = "" if transition.changed else " (it had already ended so)"
        message = "tx %s of producer group %s: %s after %d check(s)%s"
        return (logger.info, (message, tx_id, group, verdict, claim.check_count, already)), False

    def _circuit_changed(self, group: str) -> Callable[[CircuitState], None]:
        def changed(state: CircuitState) -> None:
            _metrics.CIRCUIT_STATE.labels(group).set(state)
            log = logger.warning if state is CircuitState.OPEN else logger.info
            log("circuit of producer group %s's endpoint is now %s", group, state.name.lower())

        return changed

    def _refresh_ages(self, conn: psycopg.Connection[Any]) -> None:
        """The prepared-records-by-age gauges: one pass over prepared rows, throttled."""
        interval = self.settings.metrics_interval.total_seconds()
        mono = time.monotonic()
        if self._ages_refreshed_at is not None and mono - self._ages_refreshed_at < interval:
            return
        self._ages_refreshed_at = mono
        now = self._now()
        try:
            with conn.transaction():
                conn.execute(
                    queries.query("checker_statement_timeout", self.schema),
                    {"timeout": _AGES_STATEMENT_TIMEOUT},
                )
                row = conn.execute(
                    queries.query("checker_prepared_ages", self.schema), {"now": now}
                ).fetchone()
        except pg_errors.QueryCanceled:
            logger.warning("prepared records by age: cancelled after %s", _AGES_STATEMENT_TIMEOUT)
            return
        assert row is not None
        columns = ("total", "oldest", *(c for _, c in _metrics.AGE_BUCKETS[1:]))
        values = dict(zip(columns, row, strict=True))
        for label, column in _metrics.AGE_BUCKETS:
            _metrics.PREPARED.labels(label).set(values[column])
        oldest = values["oldest"]
        _metrics.OLDEST_PREPARED.set(
            max(0.0, (now - oldest).total_seconds()) if isinstance(oldest, datetime) else 0.0
        )

    # --- lifecycle ---------------------------------------------------------------------------

    def schema_problem(self) -> str | None:
        """outbox.migrations.schema_problem() of its schema: why it cannot work on it, or None."""
        with self._round_lock:
            return schema_problem(self._connection(), self.schema, CHECKER_SCHEMA_VERSION)

    def run(self) -> None:
        """Rounds until ``stop()``: at once while batches come full, else every poll interval.

        Ends by itself on a schema it cannot work with (see outbox.migrations.schema_problem),
        so that the process exits with the reason in its log instead of failing every round.
        """
        failures = 0
        schema_checked = False
        while not self._stop.is_set():
            if not schema_checked:
                try:
                    problem = self.schema_problem()
                    schema_checked = True
                except psycopg.Error:
                    problem = None  # not reachable yet: the round fails, backs off, checks again
                if problem:
                    logger.critical("checker stopped: %s", problem)
                    self._close()
                    return
            try:
                result = self.run_once()
                failures = 0
            except Exception as exc:
                failures += 1
                kind = "database" if isinstance(exc, psycopg.Error) else type(exc).__name__
                logger.error("check round failed (%s): %s", kind, exc, exc_info=kind != "database")
                self._stop.wait(min(_MAX_FAILURE_WAIT_S, 0.5 * 2 ** min(failures, 10)))
                continue
            if not result.full:
                self._stop.wait(self.settings.poll_interval.total_seconds())
        self._close()

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the checker is already started")
        if self._closed:
            raise RuntimeError("the checker is stopped")
        self._thread = threading.Thread(target=self.run, name="outbox-checker", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the round in flight (its requests sent are bounded by their timeouts; those
        not begun are given back), then close connections and workers. Safe to call twice, and
        without ``start()``."""
        self._stop.set()
        if self._thread is not None:
            grace = 30.0 if timeout is None else timeout
            self._thread.join(grace)
            if self._thread.is_alive():
                logger.error("check round still running after %ss; leaving it", grace)
            return
        with self._round_lock:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for endpoint in self._endpoints.values():
            endpoint.pool.shutdown(wait=False, cancel_futures=True)
            endpoint.client.close()
        self._drop_connection()
        self._db_probe.close()

    def __enter__(self) -> Checker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- probes ------------------------------------------------------------------------------

    def running(self) -> bool:
        """Its thread still runs (after stop(): it did not stop within the grace)."""
        return self._thread is not None and self._thread.is_alive()

    def ended_by_itself(self) -> bool:
        """Its thread ended without being asked to (a setting that cannot work): the process
        should exit. A thread that is slow or stuck is for the liveness probe to judge."""
        thread = self._thread
        return thread is not None and not thread.is_alive() and not self._stop.is_set()

    def stale_after_s(self) -> float:
        """No round finished for this long: stuck. A round's own allowance, plus the longest
        wait between rounds and the longest a round may ask an endpoint (a request starts
        within lease_margin, or is given back, and lasts at most its timeout). A poll interval
        above the allowance failed the liveness probe of a checker that was only waiting."""
        s = self.settings
        asking = max((e.timeout for e in s.endpoints.values()), default=timedelta(0))
        return ROUND_ALLOWANCE_S + (s.poll_interval + asking + s.lease_margin).total_seconds()

    def alive(self, stale_after_s: float | None = None) -> bool:
        """False when the round thread died or has not finished a round for a long time."""
        if self._thread is None:
            return not self._closed
        limit = self.stale_after_s() if stale_after_s is None else stale_after_s
        return self._thread.is_alive() and time.monotonic() - self._last_round_at < limit

    def ready(self) -> dict[str, Any]:
        """What /readyz reports. ``ready`` needs the database only: an endpoint that is down is
        the producer's problem and must not take the sidecar (and its pod) out of service."""
        database = gather(
            {"database": self._db_probe.reachable},
            CHECK_WITHIN_S,
            late=lambda _: False,
            in_flight=self._ready_checks,
        )["database"]
        return {
            "ready": database and not self._closed,
            "database": database,
            "last_round_ok": self._last_round_ok,
            "circuits": {e.group: e.breaker.state.name.lower() for e in self._endpoints.values()},
            "checker_id": self.checker_id,
        }
