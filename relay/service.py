"""The relay: leases its shards, wakes on commits, and delivers each shard in rounds.

`run_once()` does one round (tests call it directly); `start()` runs rounds in a thread until
`stop()`, which lets the round in flight finish (or abort its Kafka transaction), hands the
shards back so another relay takes them at once, and tolerates being called twice.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from confluent_kafka import KafkaError, KafkaException
from psycopg import sql

from outbox import sql as queries
from outbox import wakeup_channel
from outbox.migrations import (
    RELAY_SCHEMA_VERSION,
    SHIPPING_CLAIM_VERSION,
    current_version,
    schema_problem,
)
from relay import metrics
from relay.background import BackgroundConnection
from relay.config import LIBRDKAFKA_MESSAGE_MAX_BYTES, SidecarSettings, marker_size_refused
from relay.dbconnect import bound_idle_time, dead_peer_options, own_transaction_mode
from relay.dbprobe import DatabaseProbe
from relay.http import CHECK_WITHIN_S, InFlight, gather
from relay.kafka import (
    Fenced,
    OutcomeUnknown,
    ProducerFailed,
    ProducerMisconfigured,
    ShuttingDown,
    Topics,
    TransactionTimedOut,
    dead_letter_topic_config,
)
from relay.leases import LeaseManager, ShardCountMismatch
from relay.markers import MarkerTooNew, marker_partition, outbox_name
from relay.pipelined import pipelined_transaction
from relay.shard import (
    DeadLetterUnwritable,
    EndFailed,
    LeaseLost,
    MarkersNotFound,
    MarkerTopicRefused,
    OutElsewhere,
    ShardRound,
    ShardWorker,
    Unstamped,
    UnstampedSeen,
)
from relay.sharding import shard_ranges

logger = logging.getLogger(__name__)

_MAX_BACKOFF_S = 10.0
# error kinds whose message says it all: logged without a traceback
_KINDS_SAID = (
    "database",
    "kafka",
    "fenced",
    "dead_letter_unwritable",
    "transaction_timeout",
    "marker_too_new",
)
STAMP_SLICE = 50_000  # rows per stamping transaction: ~1.5 s here, well inside a lease
FAR_XIDS_COUNTED = 100_000  # records of another cluster's transaction ids counted at most
FULL_STAMP_EVERY_S = 60.0  # a stamp of every unstamped row, not only above the last horizon
MIN_IDLE_TRANSACTION = timedelta(seconds=5)  # see _connect
# A stamp gives up waiting for a row lock after this (relay_stamp_plan), well before Postgres's
# deadlock_timeout (1 s by default) would end it or the other relay's end, and is made again:
# an end holds its rows for milliseconds.
STAMP_LOCK_TIMEOUT = {"lock_timeout": "200ms"}
STAMP_LOCK_ATTEMPTS = 25  # ~5 s of waiting for locks, with the leases renewed in between
# A round that held transactions back for another relay's shard looks again this soon (that
# relay's rounds take tens of ms), not after the poll interval.
HELD_BACK_POLL_S = 0.05
# Commits the xid horizon holds back are looked for at least this often, whatever the poll
# interval: the end of the transaction holding it wakes nobody, and after a hold of minutes
# the doubling wait had grown to the poll interval.
HELD_BY_HORIZON_MAX_POLL_S = 1.0
MIN_MARKER_RETENTION_MS = 24 * 3600 * 1000  # as relay.op_marker_retention's least
MARKER_TOPIC_CHECK_S = 10.0  # how often the op-marker topic's id is compared (heartbeat)
HORIZON_WARN_S = 60.0  # a transaction holding the xid horizon this long is logged, once
HAND_OVER_S = 3.0  # what a stop spends, at most, recording the shards' marker offsets
# What a stop keeps of its grace for after the batch in flight: its abort, the hand-overs and
# the hand-back. A batch still waiting for Kafka's reports then is aborted.
STOP_RESERVE_S = 8.0
HAND_BACK_CONNECT_S = 2  # a stop's connection to hand the shards back, if it needs a new one


# Refusals to create a topic that asking again will not change.
_TOPIC_CREATE_REFUSED = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.INVALID_CONFIG,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.POLICY_VIOLATION,
        KafkaError.INVALID_PARTITIONS,
    }
)

# How long a round may take before the liveness probe calls the relay stuck.
ROUND_ALLOWANCE_S = 120.0


def _gauges_stopped() -> None:
    """Left as last read, a stopped relay (a sidecar's part waiting to start again) kept saying
    it held its shards and how old the backlog was: the alerts on them kept quiet."""
    metrics.SHARDS_OWNED.set(0)
    for unknown in (metrics.BACKLOG, metrics.OLDEST_AGE, metrics.PARKED_NOW, metrics.HORIZON_HELD):
        unknown.set(math.nan)


def _backoff(failures: int) -> float:
    return min(_MAX_BACKOFF_S, 0.25 * 2.0**failures)


def _sooner(wait: float | None, retry_in: float | None) -> float | None:
    """The shorter of two waits (None: no bound). Never 0, which _wait_for_work takes for none."""
    waits = [w for w in (wait, retry_in) if w is not None]
    return max(0.001, min(waits)) if waits else None


class RelayConfigError(ValueError):
    """The relay's settings do not fit the broker's: nothing could be delivered as they are."""


def require_commit_timestamps(setting: str | None) -> None:
    """The relay orders records by commit time, and pg_xact_commit_timestamp() raises an error
    while Postgres does not track it: every round would fail."""
    if setting != "on":
        raise RelayConfigError(
            f"Postgres runs with track_commit_timestamp = {setting or 'unknown'}: the relay "
            "delivers in commit order and needs it on (set track_commit_timestamp = on in "
            "postgresql.conf and restart Postgres; transactions committed before keep the time "
            "of their last state change)"
        )


@dataclass
class RelayRound:
    delivered: int = 0
    ended: int = 0
    parked: int = 0
    full: bool = False
    held_back: bool = False
    held_by_horizon: bool = False  # committed rows wait for an older transaction to end
    shards: int = 0
    # seconds until a shard skipped or held up by a backoff (its own failure, a dead-letter
    # topic refusing copies) may go again: no wake-up comes for it
    retry_in: float | None = None

    def add(self, r: ShardRound) -> None:
        self.delivered += r.delivered
        self.ended += r.ended
        self.parked += r.parked
        self.full = self.full or r.full
        self.held_back = self.held_back or r.held_back
        seen = r.unstamped_seen
        self.held_by_horizon = self.held_by_horizon or bool(seen and seen.held_by_horizon)


class Relay:
    def __init__(self, settings: SidecarSettings) -> None:
        self.settings = settings
        rs = settings.relay
        self.schema = settings.database.schema_name
        self.relay_id = rs.relay_id or f"{socket.gethostname()}-{os.getpid()}"
        self.kafka_conf = settings.kafka.to_librdkafka()
        self.topics = Topics(self.kafka_conf)
        self.leases = LeaseManager(self.schema, self.relay_id, rs.shards, rs.lease_duration)
        self.workers: dict[int, ShardWorker] = {}
        self.ender = BackgroundConnection(self._connect, "ender")
        self.claimer = (
            BackgroundConnection(self._connect, "claimer") if settings.relay.claim_ahead else None
        )
        self._conn: psycopg.Connection[Any] | None = None
        self._listen: psycopg.Connection[Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._set_up = False
        self._marks_shipping = True  # set up: as the schema allows (_check_schema)
        self.outbox: str | None = None  # "<database>/<schema>", named in its op markers
        self._counted: Exception | None = None  # a shard's failure raised as the round's
        self._last_heartbeat = 0.0
        self._last_renewal = 0.0  # of the leases alone, while a shard waits on Kafka
        self._stop_by = math.inf  # time.monotonic() by when a stop asked to be done
        self._leases_renewed_at = 0.0  # the last heartbeat or renewal that went through
        # A setting that cannot work, found by a heartbeat between rounds: the waits end, and
        # the next round's heartbeat (still due) stops the relay. Only logged, it ran on.
        self._refused: RelayConfigError | None = None
        self._last_trim = 0.0
        self._audit_trim_refused = False  # the role may not delete from audit_log: said once
        self._holder_seen: tuple[tuple[int, str], float] | None = None  # (pid, xid), first seen
        self._marker_topic_id: str | None = None  # the op-marker topic's, as first seen
        self._marker_topic_id_now: str | None = None  # another id, once found: it stays refused
        self._marker_topic_checked_at = -float("inf")
        self._holder_warned: tuple[int, str] | None = None  # (pid, xid) last logged
        self._gauge_conn: psycopg.Connection[Any] | None = None  # refresh_gauges' own
        # What the last gauge refresh read: whether this relay counted the backlog (one relay
        # does), and the oldest undelivered commit time then (None: no backlog). None: no read.
        self._last_counted: tuple[bool, datetime | None] | None = None
        # held by a refresh using _gauge_conn: the stop must not close it under the refresh
        # (libpq's connection freed while another thread reads on it)
        self._gauge_lock = threading.Lock()
        self._db_probe = DatabaseProbe(
            lambda: self._connect(autocommit=True),
            wait_s=self.settings.database.connect_timeout_s,
            owner="the relay's",
        )
        self._ready_checks = InFlight()  # /readyz's checks still running
        self._stamped_below = "0"  # an xid8: every committed row of the owned shards below it
        # is stamped (see _stamp)
        self._next_full_stamp = 0.0
        self._stamp_resets = 0
        self._backlog_unstamped = False  # the last claim left a backlog unstamped: stamp it
        self.last_round_at = time.monotonic()
        self._listen_lost_at = -math.inf  # when the LISTEN connection last failed
        self._gained = False  # a shard gained since the round began: a round for it at once

    # --- connections ------------------------------------------------------------------------

    def _connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        database = self.settings.database
        dsn = database.dsn.get_secret_value()
        options = {
            # libpq takes whole seconds, and 0 means none: round up
            "connect_timeout": max(1, math.ceil(database.connect_timeout_s)),
            "application_name": f"outbox-relay {self.relay_id}"[:63],
            **dead_peer_options(dsn, database.connect_timeout_s),
            **database.connect_options(),
            **kwargs,
        }
        conn = own_transaction_mode(psycopg.connect(dsn, **options))
        if database.transaction_pooling:
            return conn
        # A transaction idle longer than the lease is a relay gone (or frozen): its lock on the
        # lease row kept the shard from the heir. Not sooner than a few seconds: a busy machine
        # may pause a live relay for one.
        idle = max(self.settings.relay.lease_duration, MIN_IDLE_TRANSACTION)
        return bound_idle_time(conn, idle, database.connect_timeout_s)

    @property
    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = self._connect()
            self._stamp_all_again()  # maybe a database restored meanwhile
        return self._conn

    def _drop_connection(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    # --- one round --------------------------------------------------------------------------

    def setup(self) -> None:
        """Create the op-marker and dead-letter topics when missing; check Postgres settings."""
        rs = self.settings.relay
        retention_ms = str(int(rs.op_marker_retention.total_seconds() * 1000))
        # by time only: a broker-wide log.retention.bytes would delete markers however recent
        marker_config = {
            "cleanup.policy": "delete",
            "retention.ms": retention_ms,
            "retention.bytes": "-1",
        }
        for topic, partitions, config in (
            (rs.op_marker_topic, rs.op_marker_partitions, marker_config),
            (rs.dead_letter_topic, 1, dead_letter_topic_config(self.kafka_conf)),
        ):
            try:
                self.topics.ensure(topic, partitions, config)
            except KafkaException as exc:
                # The broker will not make it as asked, however often asked: stop, saying so,
                # instead of a relay that retries for ever behind green probes.
                if exc.args[0].code() not in _TOPIC_CREATE_REFUSED:
                    raise
                raise RelayConfigError(
                    f"topic {topic} is missing and the broker refuses to create it "
                    f"({exc.args[0].str()}): create it, or let the relay's principal create it"
                ) from exc
        self._check_schema()
        self._check_marker_topic()
        self._check_marker_partitions()
        (database,) = self.conn.execute("SELECT current_database()").fetchone() or ("",)
        self.outbox = outbox_name(database, self.schema)
        row = self.conn.execute("SHOW track_commit_timestamp").fetchone()
        self.conn.rollback()
        require_commit_timestamps(row[0] if row else None)
        self._check_functions_callable()
        self._set_up = True

    def _check_functions_callable(self) -> None:
        """Every claim reads which transactions run and when they committed (relay.sql,
        relay_running_xids), through catalog functions every role may call unless a hardened
        database revoked that: each round then failed, behind a relay that seemed to run.
        (Postgres checks the right to call a function when the statement starts, rows or not.)"""
        try:
            self.conn.execute(queries.query("relay_running_xids", self.schema))
            self.conn.execute(queries.query("relay_commit_times_of_running", self.schema))
        except psycopg.errors.InsufficientPrivilege as exc:
            raise RelayConfigError(
                f"the relay's database role may not read which transactions run and when they "
                f"committed ({exc.diag.message_primary}): it orders records by commit time. "
                "Grant it EXECUTE ON FUNCTION pg_stat_get_activity(integer), pg_prepared_xact(), "
                "pg_xact_commit_timestamp(xid), pg_current_snapshot(), pg_snapshot_xip(pg_snapshot)"
            ) from exc
        finally:
            self.conn.rollback()

    def _check_schema(self) -> None:
        problem = schema_problem(self.conn, self.schema, RELAY_SCHEMA_VERSION)
        if problem:
            raise RelayConfigError(problem)
        self._check_shipping_claim(at_start=True)

    def _check_shipping_claim(self, *, at_start: bool = False) -> None:
        """Whether the schema has shipping_since: at start, then every heartbeat interval until
        it has (a migration run while the relay runs), the workers told."""
        version = current_version(self.conn, self.schema) or 0
        self._marks_shipping = version >= SHIPPING_CLAIM_VERSION
        if self._marks_shipping:
            for worker in self.workers.values():
                worker.marks_shipping = True
            if not at_start:
                logger.info(
                    "schema %s is at version %d now: discarded records are marked as they are "
                    "taken to ship",
                    self.schema,
                    version,
                )
        elif at_start:
            logger.warning(
                "schema %s is at version %d: discarded records are shipped without being "
                "marked as taken (shipping_since, version %d), so a re-arm or resolve while "
                "the relay ships them sends them out twice; run outboxctl migrate",
                self.schema,
                version,
                SHIPPING_CLAIM_VERSION,
            )

    def _check_marker_partitions(self) -> None:
        """A shard's markers are read back from the partition they were recorded in: with
        another op_marker_partitions, its worker could not be made, and its lease was held
        and renewed by a relay that never delivered its rows, probes green."""
        rs = self.settings.relay
        rows = self.conn.execute(queries.query("relay_marker_partitions", self.schema)).fetchall()
        self.conn.rollback()
        moved = [
            (shard, recorded)
            for shard, recorded in rows
            if shard < rs.shards and recorded != marker_partition(shard, rs.op_marker_partitions)
        ]
        if moved:
            shard, recorded = moved[0]
            raise RelayConfigError(
                f"shard {shard} recorded its op markers in partition {recorded}, and "
                f"relay.op_marker_partitions {rs.op_marker_partitions} would read them from "
                f"{marker_partition(shard, rs.op_marker_partitions)}: run the relays with the "
                "op_marker_partitions they had. To change it, stop every relay (each ends what "
                f"it shipped), then empty the table {self.schema}.shard_lease"
            )

    def _check_marker_topic(self) -> None:
        """Refuse to start on an op-marker topic that cannot keep what recovery reads back:
        a compacted one keeps only a shard's last message (its key), and a batch's earlier
        marker messages would be gone, its rows sent again; one of too few partitions has none
        for some shards' markers (shard % op_marker_partitions). And a marker message the broker
        or the client refuses would abort every batch: say which limit op_marker_message_bytes
        is above."""
        rs = self.settings.relay
        topic = rs.op_marker_topic
        partitions = self.topics.partitions(topic, refresh=True)
        needed = min(rs.shards, rs.op_marker_partitions)  # shard % op_marker_partitions
        if partitions == 0 and self.topics.denied(topic):
            raise RelayConfigError(
                f"the op-marker topic {topic} is hidden from the relay's principal (Topic "
                "authorization failed): it needs DESCRIBE, READ and WRITE on it"
            )
        if partitions < needed:
            raise RelayConfigError(
                f"the op-marker topic {topic} has {partitions} partitions, and {rs.shards} "
                f"shards with relay.op_marker_partitions {rs.op_marker_partitions} write to "
                f"{needed}: add partitions to it"
            )
        config = self.topics.config(topic) or {}
        retention_ms = int(config.get("retention.ms", "-1"))
        if 0 <= retention_ms < MIN_MARKER_RETENTION_MS:
            raise RelayConfigError(
                f"the op-marker topic {topic} keeps its messages {retention_ms} ms (retention.ms):"
                " a recovery reads a shard's markers back after an outage, and an idle shard "
                "moves its recorded offset on only every hour; set retention.ms to at least a "
                "day, above the longest outage"
            )
        retention_bytes = int(config.get("retention.bytes", "-1"))
        if retention_bytes >= 0:
            raise RelayConfigError(
                f"the op-marker topic {topic} keeps {retention_bytes} bytes a partition "
                "(retention.bytes): retention by size deletes markers however recent, those a "
                "recovery needs included; set retention.bytes=-1 (retention.ms bounds it)"
            )
        if "compact" in config.get("cleanup.policy", ""):
            raise RelayConfigError(
                f"the op-marker topic {topic} is compacted (cleanup.policy="
                f"{config['cleanup.policy']}): it would keep only each shard's last marker "
                "message, and recovery would send records again; set cleanup.policy=delete"
            )
        max_bytes = config.get("max.message.bytes")
        limits = {
            f"max.message.bytes of topic {topic}": None if max_bytes is None else int(max_bytes),
            "the producer's message.max.bytes": int(
                self.kafka_conf.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES)
            ),
        }
        for name, limit in limits.items():
            if limit is not None and (why := marker_size_refused(rs, name, limit)):
                raise RelayConfigError(why)

    def heartbeat(self) -> None:
        asked_at = time.monotonic()  # the leases run from about then, not from this end
        try:
            # stopping: renew what it holds (until it hands them back), take nothing more
            changes = self.leases.heartbeat(self.conn, take=not self._stop.is_set())
        except ShardCountMismatch as exc:
            # Relays with different shard counts map keys to shards differently: their leases
            # do not exclude each other, and both would send the same rows. A shard's markers
            # are read back only by that shard, too: rows in doubt would go again.
            raise RelayConfigError(
                f"the outbox's shard leases were made for {exc.running} shards, this relay is "
                f"configured with {exc.configured} (OUTBOX_RELAY__SHARDS): relays with "
                "different counts would send the same records. To change the count, stop every "
                "relay (each ends what it shipped; after a crash, start one with the old count "
                f"first, so that it recovers), then empty the table {self.schema}.shard_lease, "
                "and start the relays with the new count"
            ) from None
        for shard in changes.lost:
            lost = self.workers.get(shard)
            if lost is not None:
                self._drop_worker(lost)
        for shard in changes.to_release:
            worker = self.workers.pop(shard, None)
            if worker is not None:
                worker.close_and_hand_over(self.conn)
            # Not _drop_worker(): it forgets the lease, and release() then had nothing to hand
            # back; the shard waited for its lease to run out before another relay took it.
            self.leases.release(self.conn, shard)
        for i, lease in enumerate(changes.gained):
            try:
                self.workers[lease.shard] = ShardWorker(
                    lease,
                    self.settings.relay,
                    self.schema,
                    self.relay_id,
                    self.kafka_conf,
                    self.topics,
                    self.ender,
                    self.claimer,
                    self.outbox,
                    ending_elsewhere=functools.partial(self._ending_elsewhere, lease.shard),
                    stopping=self._stop.is_set,
                    marks_shipping=self._marks_shipping,
                )
            except Exception:
                # Held without a worker, a shard was renewed for ever and never delivered,
                # probes green: this one and those not built yet go back, for a relay that can.
                for unbuilt in changes.gained[i:]:
                    self.leases.release(self.conn, unbuilt.shard)
                raise
        if changes.gained:  # their rows may be left unstamped by another relay
            self._stamp_all_again()
            # Their commits' wake-ups came before: they would wait for the poll interval.
            self._gained = True
        metrics.SHARDS_OWNED.set(len(self.workers))
        self._set_wake_relays()
        # Last: it may wait on Kafka, and the lease changes are all acted on by now (raised
        # before, a shard gained was renewed for ever with no worker). Before the heartbeat
        # counts as done: refused between rounds, the next round's heartbeat is still due.
        self._check_marker_topic_id()
        self._last_heartbeat = time.monotonic()
        self._leases_renewed_at = asked_at

    def trim_archive(self, limit: int = 10_000, budget_s: float | None = None) -> int:
        """Delete archived rows past delivered_retention, `limit` rows per transaction (short
        locks), until none are left or `budget_s` (default: half a heartbeat) is spent. With
        no archive (0) too: the rows an archive kept before it was turned off go then."""
        retention = self.settings.relay.delivered_retention
        return self._trim("relay_trim_archive", retention, limit, budget_s)

    def trim_audit_log(self, limit: int = 10_000, budget_s: float | None = None) -> int:
        """Delete audit_log entries past audit_retention (0: kept for ever), as trim_archive.

        A relay role granted before this retention existed may not delete them: that is said
        once, and the relay goes on without it (its deliveries matter more than the trim)."""
        retention = self.settings.relay.audit_retention
        if not retention or self._audit_trim_refused:
            return 0
        try:
            return self._trim("relay_trim_audit_log", retention, limit, budget_s)
        except psycopg.errors.InsufficientPrivilege as exc:
            self._audit_trim_refused = True
            logger.warning(
                "audit_log entries are kept for ever: this role may not delete them (%s); grant "
                "it DELETE on audit_log (`outboxctl grants`) and restart the relay (it does not "
                "try again before), or set relay.audit_retention to 0",
                exc.diag.message_primary,
            )
            return 0

    def _trim(self, query: str, retention: timedelta, limit: int, budget_s: float | None) -> int:
        """Run a trim statement, a slice of `limit` rows per transaction, until a slice comes
        short or `budget_s` (default: half a heartbeat) is spent."""
        if budget_s is None:
            budget_s = self.settings.relay.heartbeat_interval.total_seconds() / 2
        deadline = time.monotonic() + budget_s
        trimmed = 0
        while True:
            with self.conn.transaction():
                self.conn.execute(queries.query("relay_no_statement_timeout", self.schema))
                cur = self.conn.execute(
                    queries.query(query, self.schema),
                    # seconds: days would be 23 or 25 hours across a DST change of the session
                    {"retention_s": retention.total_seconds(), "limit": limit},
                )
            trimmed += cur.rowcount
            if cur.rowcount < limit or time.monotonic() > deadline:
                return trimmed

    def _set_wake_relays(self) -> None:
        """While other relays hold shards, the ends wake them (ShardWorker.wake_relays). Not
        with listen_notify off: nobody listens then, and a notifying commit takes a lock."""
        rs = self.settings.relay
        wake = rs.listen_notify and len(self.workers) < rs.shards
        for worker in self.workers.values():
            worker.wake_relays = wake

    def _ending_elsewhere(self, shard: int) -> OutElsewhere:
        """Transactions the other owned shards committed in Kafka and are ending the rows of."""
        ending = [w.out_for_other_shards() for s, w in self.workers.items() if s != shard]
        return OutElsewhere(
            [xid for out in ending for xid in out.spanning],
            [xid for out in ending for xid in out.all],
        )

    def _drop_worker(self, worker: ShardWorker) -> None:
        """Close a worker whose lease is lost, and forget that lease: not a newer one of its
        shard. A heartbeat can find a shard lost and take it again (another relay took it
        while this one was paused, and gave it back), and that new lease, forgotten, was never
        renewed while its worker delivered."""
        if self.workers.get(worker.shard) is worker:
            del self.workers[worker.shard]
        worker.close()
        held = self.leases.owned.get(worker.shard)
        if held is not None and held.epoch == worker.lease.epoch:
            self.leases.forget(worker.shard)

    def run_once(self, *, pipelined: bool = False) -> RelayRound:
        """One round over the owned shards, all of it done when it returns. `pipelined` (the
        loop): the rows it delivered are left to the ender while the next round claims."""
        self._refused = None  # this round's heartbeat (still due) meets it again, if it holds
        if not self._set_up:
            self.setup()
        if self._heartbeat_due():
            self.heartbeat()
        interval = self.settings.relay.heartbeat_interval.total_seconds()
        if time.monotonic() - self._last_trim >= interval:  # its own clock: heartbeats come
            try:  # between shards too, and would starve it
                if not self._marks_shipping:
                    self._check_shipping_claim()
                self.trim_archive()
                self.trim_audit_log()
                with self.conn.transaction():
                    self.conn.execute(queries.query("relay_forget_members", self.schema))
            finally:
                # from their end: a backlog of trims took their whole budgets, and the very
                # next round trimmed again, a round of deliveries every heartbeat interval
                self._last_trim = time.monotonic()
        self._gained = False  # those gained by now are in this round
        result = RelayRound(shards=len(self.workers))
        if not self.workers:  # alive all the same: a spare relay waits for a shard to free
            self.last_round_at = time.monotonic()
            return result
        owned = sorted(self.workers)
        for claiming in self.workers.values():
            claiming.await_claim_ahead()  # claimed as of the last stamp: before the next one
        ranges = shard_ranges(owned, self.settings.relay.shards)
        hold_back, unstamped = None, None
        if self._stamp_due():
            for ending in self.workers.values():
                # The claims took rows unstamped, and a stamp would lock those whose end runs
                # meanwhile, in another order than the end: deadlocks, seen under load.
                ending.settle_quietly()
            hold_back = self._stamp(self._stamp_params(owned))
            # the stamp leaves unstamped only the committed rows the horizon holds back
            result.held_by_horizon = hold_back is not None
        else:  # the usual round: the claims bound themselves and stamp nothing
            unstamped = Unstamped(
                since=self._stamped_below,
                lo=ranges["lo"],
                hi=ranges["hi"],
                limit=self.settings.relay.batch_size * len(owned),
                resets=self._stamp_resets,
            )
        self._set_wake_relays()  # a worker dropped since the heartbeat (LeaseLost), say
        tried, failed = 0, []
        for shard in owned:
            if self._stop.is_set():
                # Stopped during the round: the shard in flight finished its batch, and no other
                # starts one, or a recovery (init_transactions alone may take
                # kafka_transaction_timeout): in a Kafka incident they overran the grace, and
                # the leases, not handed back, kept every other relay waiting for them.
                break
            self._keep_alive()  # a slow shard must not let the others' leases lapse
            worker = self.workers.get(shard)  # None: given up by that heartbeat
            if worker is None or worker.retry_at > time.monotonic():
                continue
            tried += 1
            try:
                delivered = worker.deliver_once(
                    self.conn,
                    hold_back,
                    self._keep_alive,
                    claim_ahead=pipelined,
                    unstamped=unstamped,
                    while_shipping=self._renew_while_shipping,
                )
                result.add(delivered)
                if delivered.unstamped_seen is not None:
                    self._saw_unstamped(delivered.unstamped_seen)
                if not pipelined:
                    worker.settle()
                worker.failures = 0
            except ShuttingDown as exc:
                logger.warning("shard %s: %s", shard, exc)
                break  # the stop goes on: no other shard starts a batch
            except LeaseLost as exc:  # a Fenced producer recovers: there it finds out which
                logger.warning("shard %s fenced: %s", shard, exc)
                metrics.ERRORS.labels("lease_lost").inc()
                self._drop_worker(worker)
            except (psycopg.Error, RelayConfigError):
                raise  # the connection all shards share, or a heartbeat's refusal: not one shard's
            except (ProducerMisconfigured, MarkersNotFound, MarkerTopicRefused) as exc:
                # so for every shard
                raise RelayConfigError(str(exc)) from exc
            except Exception as exc:
                # not looked up while stopping: the broker unreachable, it waited 10 s more
                if not self._stop.is_set() and self._marker_topic_gone(exc):
                    raise self._marker_topic_deleted() from exc
                # One shard's trouble (a topic without a leader, a marker partition stuck)
                # must not stop the others: it backs off alone, and recovers before it goes on.
                worker.failures += 1
                worker.needs_recovery = True
                worker.retry_at = time.monotonic() + _backoff(worker.failures)
                self._count_failure(exc, f"shard {shard}")
                failed.append(exc)
        self.last_round_at = time.monotonic()
        if failed and len(failed) == tried:
            self._counted = failed[0]  # counted above, by shard: not again as the round's
            raise failed[0]  # nothing went: the loop backs off
        result.retry_in = self._next_retry_in()
        return result

    def _next_retry_in(self) -> float | None:
        """Seconds until the first backoff of an owned shard ends, if one runs."""
        now = time.monotonic()
        due = [t for w in self.workers.values() for t in w.backoffs() if t > now]
        return min(due) - now if due else None

    def _marker_topic_replaced(self, was: str, now: str) -> RelayConfigError:
        return RelayConfigError(
            f"the op-marker topic {self.settings.relay.op_marker_topic} was deleted and made "
            f"again while the relay ran (its id was {was}, it is {now}): the markers of any "
            "batch in doubt went with the old one, and the shards' recorded offsets name "
            "neither. Stop every relay; to go on, accepting that such a batch may go again, "
            "empty shard_lease and start them"
        )

    def _marker_topic_deleted(self) -> RelayConfigError:
        topic = self.settings.relay.op_marker_topic
        if self.topics.denied(topic):
            return RelayConfigError(
                f"the op-marker topic {topic} is hidden from the relay's principal now (Topic "
                "authorization failed): it needs DESCRIBE, READ and WRITE on it; restart the "
                "relay once they are granted"
            )
        return RelayConfigError(
            f"the op-marker topic {self.settings.relay.op_marker_topic} was deleted while the "
            "relay ran (or its principal may no longer see it: its ACLs), and the markers of "
            "any batch in doubt with it. Stop every relay; if it was deleted, to go on, "
            "accepting that such a batch may go again, empty shard_lease and start them (the "
            "topic is made again)"
        )

    def _check_marker_topic_id(self) -> None:
        """The op-marker topic deleted and made again under its name while the relay ran
        (another relay's start makes it): the relay wrote on into the new one, its shards
        recording the old topic's id with offsets in the new, and every restart was refused.
        Found at a heartbeat, it stops the relay as a deletion seen does. Asked every
        MARKER_TOPIC_CHECK_S, briefly: the broker unreachable, the next heartbeat waited.
        Once found, every heartbeat refuses: one between rounds is said by the next round's."""
        if self._marker_topic_id_now is not None:
            assert self._marker_topic_id is not None
            raise self._marker_topic_replaced(self._marker_topic_id, self._marker_topic_id_now)
        if time.monotonic() < self._marker_topic_checked_at + MARKER_TOPIC_CHECK_S:
            return
        self._marker_topic_checked_at = time.monotonic()
        try:
            now = self.topics.topic_id(self.settings.relay.op_marker_topic, timeout_s=2.0)
        except (KafkaException, TimeoutError):
            return  # the broker unreachable, say: asked again later
        if now is None:
            return  # missing: the rounds find out (_marker_topic_gone)
        if self._marker_topic_id is None:
            self._marker_topic_id = now
        elif now != self._marker_topic_id:
            self._marker_topic_id_now = now
            raise self._marker_topic_replaced(self._marker_topic_id, now)

    def _marker_topic_gone(self, exc: Exception) -> bool:
        """A Kafka failure of a shard whose cause is the op-marker topic deleted: every round
        failed on its markers (no delivery report in time) behind green probes, and nothing
        made the topic again (only setup does)."""
        if not isinstance(exc, KafkaException | OutcomeUnknown | ProducerFailed):
            return False
        try:
            return self.topics.partitions(self.settings.relay.op_marker_topic, refresh=True) == 0
        except KafkaException:  # the broker unreachable, say: not known to be gone
            return False

    def _stamp_params(self, owned: list[int]) -> dict[str, Any]:
        """The stamp's shards: their key ranges, and the leases that fence it."""
        return {
            **shard_ranges(owned, self.settings.relay.shards),
            "shards": owned,
            "epochs": [self.workers[shard].lease.epoch for shard in owned],
            "owner": self.relay_id,
        }

    def _stamp(self, params: dict[str, Any]) -> datetime | None:
        """Stamp the commit time of the owned shards' rows below the xid horizon; return the
        hold-back (relay.sql, relay_hold_back). Only some rounds stamp (`_stamp_due`): in the
        others, the claims read the few rows unstamped (Unstamped). A large backlog is stamped
        a slice per transaction, with leases renewed in between: one UPDATE of a million rows
        held the horizon and its locks for a minute, longer than a lease.

        A complete stamp (not cut at a slice) leaves every committed row of the owned shards
        below the horizon it started with stamped, and the next stamps and hold-backs look
        only above that (`_stamped_below`): the index entries of the rows stamped before stay
        until a vacuum, and after a large backlog one scan of them took ~0.5 s, a round's
        stamp and hold-back two. A shard gained starts over from 0 (its rows may be left
        unstamped by another relay), and so do a new connection (the database may have been
        restored) and a stamp every FULL_STAMP_EVERY_S, which finds a row put back by hand with
        an old transaction id. A round that stamps nothing moves `_stamped_below` to the
        lowest transaction id its claims left unstamped below the horizon.
        """

        def stamp_once(with_hold_back: bool) -> tuple[bool, psycopg.Cursor[Any] | None, str]:
            bounded = {**params, "stamped_below": self._stamped_below}
            with pipelined_transaction(self.conn):  # 2 round trips
                plan = self.conn.execute(
                    queries.query("relay_stamp_plan", self.schema), STAMP_LOCK_TIMEOUT
                )
                # Unprepared: custom plans, which can estimate the key ranges.
                stamped = self.conn.execute(
                    queries.query("relay_stamp_commit_ts", self.schema),
                    {**bounded, "limit": STAMP_SLICE},
                    prepare=False,
                )
                held = None
                if with_hold_back:
                    # Read after the stamp: a transaction that took its commit time before a
                    # stamped row's transaction ended had its xid by then; still running, it is
                    # in the list, and ended since, relay_hold_back's own snapshot sees its rows.
                    self.conn.execute(queries.query("relay_running_xids", self.schema))
                    held = self.conn.execute(
                        queries.query("relay_hold_back", self.schema), bounded, prepare=False
                    )
            horizon = plan.fetchone()[-1]  # type: ignore[index]
            _count, complete = stamped.fetchone()  # type: ignore[misc]
            return complete, held, horizon  # the pipeline synced: all results are in

        def stamp(with_hold_back: bool) -> tuple[bool, psycopg.Cursor[Any] | None, str]:
            """A slice, made again while it gives up waiting for a row lock (relay_stamp_plan):
            the end that held the lock is done by then."""
            for attempt in range(1, STAMP_LOCK_ATTEMPTS + 1):
                try:
                    return stamp_once(with_hold_back)
                except psycopg.errors.LockNotAvailable:
                    if attempt == STAMP_LOCK_ATTEMPTS:
                        raise
                    metrics.STAMP_LOCK_WAITS.inc()
                    self._keep_alive()
            raise AssertionError("unreachable")

        if time.monotonic() >= self._next_full_stamp:
            self._stamp_all_again()
            self._say_xids_of_another_cluster(params)
            self._next_full_stamp = time.monotonic() + FULL_STAMP_EVERY_S
        resets = self._stamp_resets
        complete, held, horizon = stamp(with_hold_back=True)
        while not complete:
            if self._stop.is_set():
                # The rest is the next owner's: at ~1.5 s a slice, a million rows' stamping
                # took ~30 s, past the grace. No shard starts a batch after a stop (run_once).
                return None
            self._keep_alive()  # a backlog of millions is many slices: no stall
            complete, held, horizon = stamp(with_hold_back=False)
        if held is None:
            with self.conn.transaction():
                self.conn.execute(
                    queries.query("relay_stamp_plan", self.schema), STAMP_LOCK_TIMEOUT
                )
                self.conn.execute(queries.query("relay_running_xids", self.schema))
                held = self.conn.execute(
                    queries.query("relay_hold_back", self.schema),
                    {**params, "stamped_below": self._stamped_below},
                    prepare=False,
                )
        if self._stamp_resets == resets:  # else a reset came meanwhile (a shard gained, ...)
            self._stamped_below = horizon  # the last slice was complete
            self._backlog_unstamped = False
        row = held.fetchone()
        return row[0] if row else None

    def _stamp_due(self) -> bool:
        """Does this round stamp? At the start and after a reset (`_stamped_below` is 0), when
        a full stamp is due, and when the last claims left more than a batch a shard unstamped
        below the horizon (a backlog: stamped, so that each claim reads an index in commit
        order instead of sorting the backlog). Else the claims read the few rows unstamped."""
        return (
            self._stamped_below == "0"
            or self._backlog_unstamped
            or time.monotonic() >= self._next_full_stamp
        )

    def _saw_unstamped(self, seen: UnstampedSeen) -> None:
        """After an unstamped claim: a backlog to stamp next round, or few rows, the lowest of
        which every committed row below is stamped."""
        self._backlog_unstamped = seen.backlog
        if self._stamp_resets == seen.resets:  # else a shard was gained since, or the like
            self._stamped_below = seen.lowest or seen.horizon

    def _say_xids_of_another_cluster(self, params: dict[str, Any]) -> None:
        """Records no claim will ever take, said at each full stamp while they are there
        (relay.sql, relay_xids_of_another_cluster): they were waited for in silence."""
        with pipelined_transaction(self.conn):
            # the unstamped index, as the stamp: statistics may make a scan of the whole table
            self.conn.execute(queries.query("relay_stamp_plan", self.schema), STAMP_LOCK_TIMEOUT)
            count, first_id, first_xid = self.conn.execute(
                queries.query("relay_xids_of_another_cluster", self.schema),
                {"lo": params["lo"], "hi": params["hi"], "limit": FAR_XIDS_COUNTED},
                prepare=False,
            ).fetchone()  # type: ignore[misc]
        if not count:
            return
        metrics.ERRORS.labels("xid_of_another_cluster").inc()
        logger.error(
            "%s%d committed records of shards %s (id %d among them) carry transaction ids this "
            "database has not given yet (from %s): they were written in another Postgres "
            "cluster (a dump restored, a logical replica promoted), and no xid horizon passes "
            "them, so neither they nor what their shards committed after them is delivered. "
            "Give them this cluster's transaction ids (README, \"Moving the database to another "
            'cluster")',
            "at least " if count >= FAR_XIDS_COUNTED else "",
            count,
            ", ".join(map(str, params["shards"])),
            first_id,
            first_xid,
        )

    def _stamp_all_again(self) -> None:
        """The next stamp and hold-back look at every unstamped row, not only above the last
        complete stamp's horizon (see _stamp)."""
        self._stamped_below = "0"
        self._stamp_resets += 1

    def _keep_alive(self) -> None:
        if self._heartbeat_due():
            self.heartbeat()
            self.last_round_at = time.monotonic()  # a long round (a large stamp) is no stall

    def _renew_while_shipping(self) -> None:
        """While a shard waits for Kafka's reports (up to kafka_transaction_timeout), and before
        its commit: renew the leases, and count it as progress. Only renew: a heartbeat may hand
        back the shard being shipped. Without it, a batch slower than lease_duration let every
        lease of this relay lapse; another relay took the shards and fenced the batch, and the
        next owner met the same slow batch. A database that fails it fails no batch here."""
        asked_at = time.monotonic()
        if self._stop.is_set() and asked_at >= self._stop_by - STOP_RESERVE_S:
            raise ShuttingDown("the relay stops: the batch waiting for Kafka is aborted")
        interval = self.settings.relay.heartbeat_interval.total_seconds()
        if asked_at - max(self._last_heartbeat, self._last_renewal) < interval:
            return
        self._last_renewal = asked_at
        try:
            lost = self.leases.renew(self.conn)
        except psycopg.Error as exc:
            logger.warning("leases not renewed while waiting for Kafka: %s", exc)
            return
        self._leases_renewed_at = asked_at
        self.last_round_at = time.monotonic()  # reports come in, or the wait is bounded
        if lost:
            logger.info("shards %s were taken over while waiting for Kafka", lost)

    def _heartbeat_due(self) -> bool:
        interval = self.settings.relay.heartbeat_interval.total_seconds()
        return time.monotonic() - self._last_heartbeat >= interval

    # --- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        """Rounds until stop(): at once while batches come full, else after a wake-up or poll."""
        failures = 0
        held_back_wait = HELD_BACK_POLL_S
        if self.settings.relay.listen_notify:
            try:
                self._listening()  # from the start: a drain asks it between rounds
            except psycopg.Error:  # the wait for work tries again, then rounds at once (lost)
                self._listen_lost_at = time.monotonic()
        while not self._stop.is_set():
            try:
                result = self.run_once(pipelined=True)
                failures = 0
            except RelayConfigError as exc:
                # Nothing could be delivered as configured: stop, so that /healthz fails and
                # the container restarts with the error in its log, instead of retrying forever.
                logger.critical("relay stopped: %s", exc)
                break
            except Exception as exc:
                failures += 1
                # A round that failed is a round: the loop goes on, and a restart would not
                # bring the database or the broker back (the liveness probe restarted a relay
                # every few minutes through an outage, and crash-loop backoff delayed it after).
                self.last_round_at = time.monotonic()
                self._on_failure(exc)
                self._pause(_backoff(failures))
                continue
            if (result.held_back or result.held_by_horizon) and not result.full:
                # Held back for another relay's shard: it sends within a round or two, and its
                # end wakes this one (no application's commit does). Else polled, longer each
                # time nothing went (that relay may be dead until its lease expires, or in
                # trouble), up to the poll interval. So are commits the xid horizon holds back:
                # the transaction holding it (often a relay's end, ~10 ms) wakes nobody, and
                # their wake-up was spent on a round that could not take them: they waited
                # for the poll interval.
                longest = self.settings.relay.poll_interval.total_seconds()
                if not result.held_back:  # held by the horizon alone
                    longest = min(longest, HELD_BY_HORIZON_MAX_POLL_S)
                wait = min(held_back_wait, longest)
                self._wait_for_work(_sooner(wait, result.retry_in), held_back=True)
                held_back_wait = (
                    HELD_BACK_POLL_S if result.delivered else min(2 * held_back_wait, longest)
                )
                continue
            held_back_wait = HELD_BACK_POLL_S
            if result.full:
                self._forget_wakeups()  # the next round finds what they announce
            else:
                self._wait_for_work(_sooner(None, result.retry_in))
        self._shutdown()

    def _on_failure(self, exc: Exception) -> None:
        if isinstance(exc, psycopg.Error):
            self._drop_connection()
        for worker in self.workers.values():
            worker.needs_recovery = True  # whatever was in flight is settled from the markers
        if exc is not self._counted:
            self._count_failure(exc, "relay round")
        self._counted = None

    @staticmethod
    def _count_failure(exc: Exception, what: str) -> None:
        if isinstance(exc, psycopg.Error | EndFailed):  # EndFailed: the ender's connection
            kind = "database"
        elif isinstance(exc, TransactionTimedOut):
            kind = "transaction_timeout"
        elif isinstance(exc, KafkaException | OutcomeUnknown | ProducerFailed):
            kind = "kafka"
        elif isinstance(exc, Fenced):
            kind = "fenced"
        elif isinstance(exc, DeadLetterUnwritable):
            kind = "dead_letter_unwritable"
        elif isinstance(exc, MarkerTooNew):
            kind = "marker_too_new"
        else:
            kind = type(exc).__name__
        metrics.ERRORS.labels(kind).inc()
        logger.error(
            "%s failed (%s): %s",
            what,
            kind,
            exc,
            exc_info=kind not in _KINDS_SAID,
        )

    def _wait_for_work(self, timeout: float | None = None, *, held_back: bool = False) -> None:
        """Until a commit is announced (or `timeout`, or the poll interval). `held_back`: this
        relay holds a transaction back for another relay's shard, and that relay's ends wake
        it (relay_wake_relays); else only the applications' and the checker's notifications."""
        rs = self.settings.relay
        timeout = min(rs.poll_interval.total_seconds(), timeout or float("inf"))
        if rs.listen_notify:
            listening = None
            try:
                anew = self._listen is None or self._listen.closed
                listening = self._listening()
                if anew and self._listen_lost_at > -math.inf:
                    # Listening again after a cut: what committed before LISTEN took effect
                    # announced itself to nobody. A round now finds it.
                    return
                # In short slices, so that stop() is never kept waiting for a long poll interval.
                deadline = time.monotonic() + timeout
                woke = False
                while not woke and not self._stop.is_set() and self._refused is None:
                    if self._gained:
                        return
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    woke = any(  # relay_wake_relays' payload: a relay's id
                        not n.payload or (held_back and n.payload != self.relay_id)
                        for n in listening.notifies(timeout=min(left, 0.25), stop_after=1)
                    )
                    self._heartbeat_between_rounds()
                if woke:  # drain what else arrived: one round serves them all
                    for _ in listening.notifies(timeout=0):
                        pass
            except psycopg.Error:
                if self._listen is not None:
                    self._listen.close()
                self._listen = None
                # Cut while listening, its notifications may be lost: a round now, and the
                # next wait listens anew, then a round again (the whole poll interval passed
                # deaf to commits). Not twice within an interval, nor when no connection could
                # be made: no spinning.
                now = time.monotonic()
                if listening is None or now - self._listen_lost_at < timeout:
                    self._pause(timeout, until_gained=True)
                self._listen_lost_at = now
                return
        else:
            self._pause(timeout, until_gained=True)
            if self._gained:
                return
        if rs.linger.total_seconds() > 0:
            self._pause(rs.linger.total_seconds())  # heartbeating: a linger may outlast the lease

    def _pause(self, seconds: float, *, until_gained: bool = False) -> None:
        """Wait until stop(), heartbeating when one is due: a poll interval or a failure's
        backoff longer than the lease let the leases lapse, and the shards flapped between
        relays, each move a fencing and a recovery. `until_gained`: or until a shard is
        gained (a poll interval, not a failure's backoff)."""
        deadline = time.monotonic() + seconds
        interval = self._waiting_heartbeat_s()
        while not self._stop.is_set() and self._refused is None:
            if until_gained and self._gained:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._set_up:  # no leases before setup: nothing to renew
                left = min(left, max(0.05, self._last_heartbeat + interval - time.monotonic()))
            self._stop.wait(left)
            self._heartbeat_between_rounds()
            # Read while rounds fail too (Kafka down for hours): unread, the notifications
            # filled Postgres's queue, and at 8 GB the applications' commits failed.
            self._forget_wakeups()

    def _waiting_heartbeat_s(self) -> float:
        """How often the leases are renewed while the relay waits between rounds:
        heartbeat_interval, and with 0 ("every round") a third of the lease. Not at all with 0,
        a poll interval, backoff or linger as long as the lease let every lease lapse on a quiet
        outbox: the shards moved to other relays, each move a fencing and a recovery."""
        rs = self.settings.relay
        return rs.heartbeat_interval.total_seconds() or rs.lease_duration.total_seconds() / 3

    def _heartbeat_between_rounds(self) -> None:
        """A heartbeat when one is due. A failed one is logged and tried again an interval
        later, here or by a round."""
        if (
            self._set_up
            and not self._stop.is_set()
            and self._refused is None
            and time.monotonic() - self._last_heartbeat >= self._waiting_heartbeat_s()
        ):
            try:
                self.heartbeat()
            except RelayConfigError as exc:  # still due: the next round's heartbeat stops it
                self._refused = exc
            except Exception as exc:  # the round after meets it again, and reports it
                logger.warning("heartbeat between rounds failed: %s", exc)
                if isinstance(exc, psycopg.Error):
                    self._drop_connection()
                self._last_heartbeat = time.monotonic()  # tried: again an interval later

    def _listening(self) -> psycopg.Connection[Any]:
        """The LISTEN connection, made on first use: notifications queue from then."""
        if self._listen is None or self._listen.closed:
            listen = self._connect(autocommit=True)
            # quoted: pg_notify names the channel exactly, capitals and all
            channel = sql.Identifier(wakeup_channel(self.schema))
            listen.execute(sql.SQL("LISTEN {}").format(channel))
            self._listen = listen
        return self._listen

    def _forget_wakeups(self) -> None:
        """Read the notifications pending, in a drain: left unread, they pile up in Postgres's
        notification queue, which every other listener shares."""
        if not self.settings.relay.listen_notify or self._listen is None:
            return
        try:
            for _ in self._listen.notifies(timeout=0):
                pass
        except psycopg.Error:
            self._listen.close()
            self._listen = None
            self._listen_lost_at = time.monotonic()  # the next wait listens anew, then a round

    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="outbox-relay", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop after the round in flight (a batch still waiting for Kafka's reports when
        little of the grace is left is aborted); hand the shards back. Safe to call twice."""
        grace = (
            timeout if timeout is not None else self.settings.relay.shutdown_grace.total_seconds()
        )
        self._stop_by = min(self._stop_by, time.monotonic() + grace)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(grace)
            if self._thread.is_alive():
                logger.error("relay round still running after %ss; exiting anyway", grace)
        elif not self._stopped:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        conn = self._conn  # not self.conn: no new connection in a database outage
        usable = conn if conn is not None and not (conn.closed or conn.broken) else None
        # One allowance for all the shards' hand-overs, and none after one failed: with the
        # broker unreachable, each waited its own timeout, and the stop overran its grace.
        hand_over_until = time.monotonic() + HAND_OVER_S
        for shard in list(self.workers):
            worker = self.workers.pop(shard)
            left = hand_over_until - time.monotonic()
            if not worker.close_and_hand_over(usable if left > 0.1 else None, left):
                usable = None
        if self.claimer is not None:  # claims only read: nothing waits for them any more
            self.claimer.close(timeout=0)
        # what is left of the grace: given whole again, the stop overran it
        left = min(
            self.settings.relay.shutdown_grace.total_seconds(), self._stop_by - time.monotonic()
        )
        self.ender.close(timeout=max(1.0, left))
        try:
            self.leases.leave(self._hand_back_connection())
        except psycopg.Error as exc:
            logger.warning("could not hand the shards back (they expire instead): %s", exc)
        for conn in (self._conn, self._listen):
            if conn is not None:
                conn.close()
        self._close_gauge_conn()
        self._db_probe.close()
        _gauges_stopped()
        logger.info("relay %s stopped", self.relay_id)

    def _hand_back_connection(self) -> psycopg.Connection[Any]:
        """The rounds' connection if it is whole, else a new one tried briefly. In a database
        outage the leases expire by themselves; a new connection with the usual timeout made
        a stop during a silent primary's outage wait for it again after the round it cut (19 s
        in all with the default 10 s: with 15 s, the stop overran its 25 s grace)."""
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            conn = self._conn = self._connect(connect_timeout=HAND_BACK_CONNECT_S)
        return conn

    # --- probes and gauges ------------------------------------------------------------------

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
        wait between rounds (a poll interval above the allowance failed the liveness probe of
        a relay that was only waiting), plus the longest Kafka call a round makes without
        coming up for air (a commit waits up to kafka_transaction_timeout: raised to 5 min for
        a large transaction, as its error says to, the probe killed the relay in its commit).
        The linger waited after a wake-up too: a long one failed the probe every quiet cycle."""
        rs = self.settings.relay
        return (
            ROUND_ALLOWANCE_S
            + rs.poll_interval.total_seconds()
            + rs.linger.total_seconds()
            + rs.kafka_transaction_timeout.total_seconds()
        )

    def alive(self, stale_after_s: float | None = None) -> bool:
        limit = self.stale_after_s() if stale_after_s is None else stale_after_s
        return self._thread is None or (
            self._thread.is_alive() and time.monotonic() - self.last_round_at < limit
        )

    def held_shards(self) -> list[int]:
        """The shards of this relay's workers while their leases are renewed: none once a lease
        duration passed without a heartbeat (the database unreachable), when another relay may
        hold them. /readyz and the owned gauge listed them still, through the whole outage."""
        renewed_for = time.monotonic() - self._leases_renewed_at
        if renewed_for >= self.settings.relay.lease_duration.total_seconds():
            return []
        return sorted(self.workers)

    def ready(self) -> dict[str, Any]:
        """What /readyz reports; `ready` needs the database, the broker, and the relay's
        setup (its topics made and its settings checked) done: until then it delivers nothing."""
        reached = gather(
            {"database": self._db_probe.reachable, "broker": self.topics.reachable},
            CHECK_WITHIN_S,
            late=lambda _: False,
            in_flight=self._ready_checks,
        )
        database, broker = reached["database"], reached["broker"]
        return {
            "ready": database and broker and self._set_up,
            "database": database,
            "broker": broker,
            "set_up": self._set_up,
            "shards": self.held_shards(),
            "relay_id": self.relay_id,
        }

    def refresh_gauges(self) -> None:
        """The backlog gauges, from one relay of this outbox (relay_counts_backlog; 0 on the
        others: dashboards and alerts take the max): counting the backlog reads all of it, and
        every pod of a deployment counted it every refresh. The horizon gauges (cheap), from
        every relay. On a connection kept for this: a new one each refresh was churn."""
        metrics.SHARDS_OWNED.set(len(self.held_shards()))  # first: without the database too
        metrics.SHARDS.set(self.settings.relay.shards)
        with self._gauge_lock:
            if self._closed_if_stopped():
                return
            try:
                holder = self._read_gauges()
            except Exception:
                if self._closed_if_stopped():  # the stop cancelled the read: its gauges stand
                    _gauges_stopped()
                    return
                self._gauges_unread()
                raise
            if self._closed_if_stopped():  # stopped while reading: the stop left it to us
                _gauges_stopped()  # again: what was read came after the stop's
                return
        metrics.HORIZON_HOLDER_PID.set(holder[0] if holder else 0)
        held = self._horizon_held(holder)
        metrics.HORIZON_HELD.set(held)
        if holder is not None and held >= HORIZON_WARN_S and self._holder_warned != holder[:2]:
            # The gauges name a pid only, 0 for a prepared transaction: the log says which
            # transaction, once, so an operator can end it.
            self._holder_warned = holder[:2]
            logger.warning(
                "the xid horizon has been held for %.0f s by %s (xid %s): records of "
                "transactions that took their xid after it wait until it ends",
                held,
                holder[3],
                holder[1],
            )

    def _read_gauges(self) -> tuple[Any, ...] | None:
        """The backlog gauges set; returns the horizon's holder. With _gauge_lock held."""
        conn = self._gauge_conn
        if conn is None or conn.closed or conn.broken:
            conn = self._gauge_conn = self._connect(autocommit=True)
        try:
            counts = conn.execute(
                queries.query("relay_counts_backlog", self.schema), {"relay_id": self.relay_id}
            ).fetchone()
            if counts and counts[0]:
                count, oldest, parked = conn.execute(
                    queries.query("relay_backlog", self.schema)
                ).fetchone() or (0, None, 0)
                age = conn.execute(
                    "SELECT extract(epoch FROM now() - %s::timestamptz)", (oldest,)
                ).fetchone()
                metrics.BACKLOG.set(count)
                metrics.OLDEST_AGE.set(float(age[0]) if age and age[0] is not None else 0.0)
                metrics.PARKED_NOW.set(parked)
                self._last_counted = (True, oldest)
            else:
                for counted_elsewhere in (metrics.BACKLOG, metrics.OLDEST_AGE, metrics.PARKED_NOW):
                    counted_elsewhere.set(0)
                self._last_counted = (False, None)
            holder: tuple[Any, ...] | None = conn.execute(
                queries.query("relay_horizon_holder", self.schema)
            ).fetchone()
        except psycopg.Error:
            self._close_gauge_conn_held()
            raise
        return holder

    def _gauges_unread(self) -> None:
        """A refresh that failed (the database unreachable, say). Left as last read, the age
        stayed at its value from before, ~0 at the start of an outage, and the lag alert never
        fired. The age goes on from the oldest commit time last counted: that record waits
        still, as a relay without its database delivers nothing. The counts are unknown. A
        relay that did not count the backlog (another one does) keeps its zeros."""
        metrics.HORIZON_HELD.set(math.nan)
        counted, oldest = self._last_counted or (True, None)
        if not counted:
            return
        for unknown in (metrics.BACKLOG, metrics.PARKED_NOW):
            unknown.set(math.nan)
        if oldest is None:  # no backlog then, or never read: what came since is unknown
            metrics.OLDEST_AGE.set(math.nan)
        else:
            metrics.OLDEST_AGE.set(max(0.0, (datetime.now(UTC) - oldest).total_seconds()))

    def _close_gauge_conn(self) -> None:
        """At the stop: closed now, or, a refresh reading on it, its query cancelled and the
        connection left to the refresh to close (it sees the relay stopped)."""
        if self._gauge_lock.acquire(blocking=False):
            try:
                self._close_gauge_conn_held()
            finally:
                self._gauge_lock.release()
        elif (conn := self._gauge_conn) is not None:
            # the database unreachable: the refresh ends at its own timeout
            with contextlib.suppress(psycopg.Error):
                conn.cancel_safe(timeout=1.0)

    def _closed_if_stopped(self) -> bool:
        """With _gauge_lock held: the relay stopped, its gauges' connection is closed."""
        if self._stopped:
            self._close_gauge_conn_held()
        return self._stopped

    def _close_gauge_conn_held(self) -> None:
        if self._gauge_conn is not None:
            self._gauge_conn.close()
            self._gauge_conn = None

    def _horizon_held(self, holder: tuple[Any, ...] | None) -> float:
        """Seconds the oldest running transaction has held the horizon. Its start is hidden
        from a role without pg_read_all_stats (the least-privilege grants): then the seconds
        since this relay first saw it, a lower bound. A None here failed every refresh, and
        the alert on this gauge could never fire."""
        if holder is None:
            self._holder_seen = None
            return 0.0
        pid, xid, age = holder[:3]
        if self._holder_seen is None or self._holder_seen[0] != (pid, xid):
            self._holder_seen = ((pid, xid), time.monotonic())
        return age if age is not None else time.monotonic() - self._holder_seen[1]
