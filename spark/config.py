"""Settings of the reconciliation job, and the time windows it judges.

Nothing here imports PySpark: `outboxctl` and the unit tests use it without a JVM.

Time model. The job keeps the op markers and the copies seen on the delivered topics for the
`horizon` (its observation store), and judges a record only once the `deadline` has passed since
the time that matters for it, so that its counterparts (the copy for a marker, the marker for a
copy, the copy for a committed ledger row) have had that long to appear:

    store_low            lo                                   hi          as_of
       |---- deadline ----|------------ judged ----------------|-- deadline --|
       |<-------------------------------- horizon ------------------------->|

A ledger row still waiting for the relay (committed, not ended by it) is reported missing only
once it has waited `undelivered_deadline` (10 minutes, or the deadline if longer) by `as_of` (an
audit: by now): a relay that is only behind is the lag alert's to report.

`as_of` is a time up to which Kafka has been read completely (a micro-batch's start, the start of
an availableNow run, or `--to` of an audit), never simply "now", so that a copy that is only late
in being read is not taken for a missing one.
"""

from __future__ import annotations

import getpass
import glob
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from outbox._core import check_schema_name
from outbox._dsn import check_dsn_setting, parse_dsn
from outbox._errors import InvalidConfigError, InvalidTopicError
from outbox._records import check_topic
from spark._errors import ReconcileConfigError
from spark.kafka_properties import BOOTSTRAP, refused_option

# The chart's OutboxDeliveryLagging fires once the lag has been over 300 s for 5 minutes
# (prometheusRule.deliveryLagSeconds)
DEFAULT_UNDELIVERED_DEADLINE = timedelta(minutes=10)
FINDING_KINDS = ("missing", "duplicate", "orphan", "marker_mismatch", "out_of_order")

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_MAX_DURATION_S = 36_500 * 86400.0  # past it, timestamps leave Postgres's and Spark's range


def parse_duration(text: str) -> timedelta:
    """'90' (seconds), '500ms', '30s', '5m', '1h', '2d', or a sum such as '1m30s'."""
    raw = text.strip().lower().replace(" ", "")
    try:
        seconds = float(raw)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION_PART.finditer(raw):
            if match.start() != pos:
                break
            seconds += float(match[1]) * _UNITS[match[2]]
            pos = match.end()
        if pos != len(raw) or not raw:
            raise ValueError(
                f"{text!r} is not a duration (e.g. 90, 500ms, 30s, 5m, 1h, 1m30s)"
            ) from None
    # float() takes 'inf', '-5' and '1e18': timedelta() overflowed with a traceback
    if not 0 <= seconds <= _MAX_DURATION_S:
        raise ValueError(f"{text!r}: a duration from 0 to {_MAX_DURATION_S // 86400:.0f} days")
    return timedelta(seconds=seconds)


def format_duration(value: timedelta) -> str:
    """As the flags take it (`1h30m`, `2.5s`): errors said Python's `0:01:00`."""
    micros = value // timedelta(microseconds=1)
    parts = []
    for unit, size in (("d", 86_400_000_000), ("h", 3_600_000_000), ("m", 60_000_000)):
        count, micros = divmod(micros, size)
        if count:
            parts.append(f"{count}{unit}")
    if micros or not parts:
        parts.append(f"{micros / 1_000_000:.6f}".rstrip("0").rstrip(".") + "s")
    return "".join(parts)


def parse_time(text: str) -> datetime:
    """An ISO 8601 instant; without a zone it is taken as UTC."""
    value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def trigger_end(started: str, duration_ms: Mapping[str, int] | None) -> datetime:
    """When a trigger reported in a query's progress ended: its start plus its whole run."""
    return parse_time(started) + timedelta(
        milliseconds=(duration_ms or {}).get("triggerExecution", 0)
    )


def offset_log_time(text: str) -> datetime | None:
    """When Spark planned a micro-batch, from its offset log entry (`<checkpoint>/offsets/<id>`:
    a version line, then the batch's metadata with batchTimestampMs, taken right after the
    source's offsets were fixed); None when the entry says nothing usable."""
    lines = text.splitlines()
    try:
        millis = json.loads(lines[1])["batchTimestampMs"] if len(lines) > 1 else None
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(millis, int) or millis <= 0:
        return None
    return datetime.fromtimestamp(millis / 1000, UTC)


def spark_interval(delta: timedelta) -> str:
    """A duration as Spark writes it ('1500 milliseconds'), for triggers and windows."""
    return f"{round(delta.total_seconds() * 1000)} milliseconds"


# libpq's environment variables for what a DSN leaves out (those jdbc_target passes on)
_LIBPQ_ENVIRONMENT = {
    "host": "PGHOST",
    "hostaddr": "PGHOSTADDR",
    "port": "PGPORT",
    "dbname": "PGDATABASE",
    "user": "PGUSER",
    "password": "PGPASSWORD",
    "sslmode": "PGSSLMODE",
    "sslrootcert": "PGSSLROOTCERT",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "application_name": "PGAPPNAME",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "options": "PGOPTIONS",
    "target_session_attrs": "PGTARGETSESSIONATTRS",
    "load_balance_hosts": "PGLOADBALANCEHOSTS",
}

# libpq's target_session_attrs as the JDBC driver's targetServerType says it (the driver tells
# a primary by a writable session, as libpq's read-write does).
_TARGET_SERVER_TYPE = {
    "any": "any",
    "read-write": "primary",
    "primary": "primary",
    "read-only": "secondary",
    "standby": "secondary",
    "prefer-standby": "preferSecondary",
}


SOURCE_FETCH_MAX_WAIT_MS = 10  # see kafka_source_options
# Spark's intervals are whole milliseconds: well above that, a floor that means something
_LEAST_INTERVAL = timedelta(milliseconds=100)


def jdbc_target(dsn: str, url: str | None = None) -> tuple[str, dict[str, str]]:
    """A libpq connection string as the PostgreSQL JDBC driver takes it: (url, properties).

    The password goes into the properties (Spark redacts it), never into the URL. What the DSN
    leaves out comes from libpq's environment (PGHOST, PGUSER, PGPASSWORD...), as psycopg's side
    of the job gets it: else the two sides could reach different databases. `url` (--jdbc-url)
    given, only the properties are taken from the DSN: where the driver cannot go as the DSN
    says (a Unix socket, a service file), the URL says where it goes instead.
    """
    try:
        params = parse_dsn(dsn, "--dsn")
    except InvalidConfigError as exc:  # its message never holds the DSN
        raise ReconcileConfigError(str(exc)) from None
    for name, variable in _LIBPQ_ENVIRONMENT.items():
        if params.get(name) is None and os.environ.get(variable):
            params[name] = os.environ[variable]
    if url is None:
        url = _jdbc_url(params)
    props: dict[str, str] = {"driver": "org.postgresql.Driver"}
    renamed = {
        "user": "user",
        "password": "password",
        "sslmode": "sslmode",
        "sslrootcert": "sslrootcert",
        "sslcert": "sslcert",
        "sslkey": "sslkey",
        "application_name": "ApplicationName",
        "connect_timeout": "connectTimeout",
        "options": "options",
    }
    for libpq, jdbc in renamed.items():
        if params.get(libpq) is not None:
            props[jdbc] = str(params[libpq])
    props.setdefault("connectTimeout", "10")  # seconds, as libpq's connect_timeout
    # With several hosts (a primary and its standbys), the node psycopg's side takes: else the
    # ledger was read from whichever answered first, a standby behind the primary maybe.
    attrs = params.get("target_session_attrs")
    if attrs is not None:
        if str(attrs) not in _TARGET_SERVER_TYPE:
            raise ReconcileConfigError(
                f"target_session_attrs {attrs!r} in --dsn is none of libpq's: "
                f"{', '.join(_TARGET_SERVER_TYPE)}"
            )
        props["targetServerType"] = _TARGET_SERVER_TYPE[str(attrs)]
    if params.get("load_balance_hosts") is not None:
        props["loadBalanceHosts"] = str(params["load_balance_hosts"] == "random").lower()
    return url, props


def _jdbc_url(params: dict[str, Any]) -> str:
    if params.get("service") or os.environ.get("PGSERVICE"):
        raise ReconcileConfigError(
            "the JDBC driver cannot read a libpq service file: give host, port and dbname in "
            "--dsn, or pass --jdbc-url"
        )
    hosts = str(params.get("host") or params.get("hostaddr") or "localhost").split(",")
    ports = str(params.get("port") or "5432").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)
    if len(ports) != len(hosts):
        raise ReconcileConfigError(
            f"--dsn names {len(hosts)} hosts and {len(ports)} ports: give one port, or one "
            "for each host"
        )
    if any(h.startswith("/") for h in hosts):
        raise ReconcileConfigError(
            "the JDBC driver cannot use a Unix socket: give a host in --dsn, or pass --jdbc-url"
        )
    dbname = params.get("dbname") or params.get("user") or getpass.getuser()  # as libpq
    return "jdbc:postgresql://{}/{}".format(
        ",".join(f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)), dbname
    )


class ReconcileSettings(BaseModel):
    """Everything the job reads at start (`python -m spark.job --help` documents each)."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    dsn: SecretStr = Field(description="libpq connection string of the outbox's database.")
    schema_name: str = Field(default="outbox", description="Schema of the outbox tables.")

    jdbc_url: str | None = Field(
        default=None, description="JDBC URL of the same database (default: built from dsn)."
    )
    jdbc_read_timeout: timedelta = Field(
        default=timedelta(minutes=5),
        description="How long a JDBC read of the ledger may receive nothing before it is "
        "given up, failing the micro-batch (the driver's socketTimeout).",
    )
    bootstrap_servers: str = Field(min_length=1)
    kafka_options: dict[str, str] = Field(
        default_factory=dict,
        repr=False,  # sasl.jaas.config and ssl.*.password hold secrets
        description="Further Kafka consumer properties (security.protocol, sasl.*, ssl.*).",
    )
    topics: tuple[str, ...] = Field(default=(), description="Delivered topics, by name.")
    topic_pattern: str | None = Field(default=None, description="Delivered topics, a Java regex.")
    marker_topic: str = "outbox.op-markers"
    dead_letter_topic: str = Field(
        default="outbox.dead-letter",
        min_length=1,
        description="The relay's dead-letter topic: a pattern may match it, and its records "
        "are not deliveries.",
    )
    ignored_topics: tuple[str, ...] = Field(
        default=(),
        description="Further topics a pattern may match whose records are not deliveries.",
    )
    former_outbox_names: tuple[str, ...] = Field(
        default=(),
        description='Names ("<database>/<schema>") this outbox had before a rename of its '
        "database or schema: markers and copies written under them are this outbox's too.",
    )
    deadline: timedelta = Field(
        default=timedelta(seconds=60),
        description="How long a record may take to appear on its topic (and a marker or copy "
        "to meet its counterpart) before it is reported.",
    )
    undelivered_deadline: timedelta | None = Field(
        default=None,
        description="How long a record may wait for the relay (committed, not ended by it) "
        "before it is reported missing; None: 10 minutes, or the deadline if that is longer. A "
        "relay that is only behind is the lag alert's to report: at the deadline, every record "
        "committed through a short relay outage was a finding.",
    )
    horizon: timedelta = Field(
        default=timedelta(minutes=15),
        description="How long observations are kept and findings re-judged.",
    )
    ledger_retention: timedelta | None = Field(
        default=None,
        description="The relay's delivered_retention; unknown ids newer than this are orphans. "
        "Default: derived from the oldest ended row the ledger still keeps.",
    )
    findings_retention: timedelta | None = Field(
        default=timedelta(days=30),
        description="Findings not found again, and summary windows not written, for longer "
        "than this are deleted by the job (None: kept for ever). Longer than the horizon, "
        "or a re-judged record would be reported again.",
    )
    summary_window: timedelta = Field(default=timedelta(minutes=1))
    trigger: timedelta = Field(default=timedelta(seconds=10))
    checkpoint: str | None = Field(
        default=None, description="Checkpoint location (any Hadoop file system URI)."
    )
    once: bool = Field(default=False, description="Process what is there now, then stop.")
    audit_from: datetime | None = None
    audit_to: datetime | None = None
    master: str | None = Field(default=None, description="Default: local[*] outside spark-submit.")
    jars: tuple[str, ...] = Field(default=(), description="Local jar paths for spark.jars.")
    shuffle_partitions: int | None = Field(default=None, ge=1)
    max_lookup_ids: int = Field(
        default=100_000, ge=0, description="Most ledger rows looked up by id per judgement."
    )

    @field_validator("dsn")
    @classmethod
    def _parses(cls, v: SecretStr) -> SecretStr:
        return check_dsn_setting(v, "dsn")

    @field_validator("kafka_options")
    @classmethod
    def _consumer_properties(cls, v: dict[str, str]) -> dict[str, str]:
        """Refused here by name, not by Spark when the query starts (or never: a property
        under 'kafka.' twice was ignored unsaid)."""
        if BOOTSTRAP in v:
            raise ValueError(f"{BOOTSTRAP}: give the Kafka bootstrap servers with --bootstrap")
        problems = [why for key, value in v.items() if (why := refused_option(key, value))]
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @field_validator("jars")
    @classmethod
    def _expand(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        """A local path with a glob (the reconcile image's OUTBOX_SPARK_JARS=/opt/.../*.jar) as
        the jars it matches, sorted; one matching nothing is refused by name, not left to fail
        as a missing Kafka source at the first micro-batch. URIs (hdfs:, local:) go as given."""
        out: list[str] = []
        for jar in v:
            if "://" in jar or ":" in jar.split("/", 1)[0]:
                out.append(jar)
                continue
            if not glob.has_magic(jar):
                if not os.path.isfile(jar):  # Spark leaves it out with a log line, and goes on
                    raise ValueError(
                        f"jars: {jar!r} is no file here (Spark would leave it out, and the Kafka "
                        "source or the JDBC driver in it would be missing)"
                    )
                out.append(jar)
                continue
            found = sorted(glob.glob(jar))
            if not found:
                raise ValueError(f"jars: {jar!r} matches no file")
            out.extend(found)
        return tuple(out)

    @field_validator("jdbc_url")
    @classmethod
    def _postgres_jdbc_url(cls, v: str | None) -> str | None:
        # else taken, and refused by the driver at the first ledger read, after Kafka was read
        if v is not None and not v.startswith("jdbc:postgresql:"):
            scheme = v.split("//", 1)[0][:40]  # not the rest: it may hold a password
            raise ValueError(
                f"not a PostgreSQL JDBC URL (jdbc:postgresql://host:port/dbname): it begins "
                f"{scheme!r}"
            )
        return v

    @field_validator("topics", "marker_topic", "dead_letter_topic")
    @classmethod
    def _kafka_topic_names(cls, v: str | tuple[str, ...]) -> str | tuple[str, ...]:
        # Spark's subscribe list drops an empty name unsaid: with an empty marker topic, every
        # copy was reported as a record without its marker
        for name in (v,) if isinstance(v, str) else v:
            try:
                check_topic(name)
            except InvalidTopicError as exc:
                raise ValueError(str(exc)) from None
        return v

    @field_validator("schema_name")
    @classmethod
    def _identifier(cls, v: str) -> str:
        return check_schema_name(v)

    @field_validator(
        "deadline",
        "undelivered_deadline",
        "horizon",
        "summary_window",
        "trigger",
        "jdbc_read_timeout",
    )
    @classmethod
    def _positive(cls, v: timedelta | None) -> timedelta | None:
        if v is not None and v <= timedelta(0):
            raise ValueError("must be positive")
        return v

    @field_validator("trigger", "summary_window")
    @classmethod
    def _whole_milliseconds(cls, v: timedelta) -> timedelta:
        # Spark takes whole milliseconds: 0.4 ms was a trigger of 0 (micro-batches back to
        # back, the idle ticker polling every 0.2 ms) and a summary window of 0 (every first
        # judgement failed, the job restarting in a loop)
        if v < _LEAST_INTERVAL:
            raise ValueError(f"must be at least {_LEAST_INTERVAL.total_seconds():g}s")
        return v

    @field_validator("audit_from", "audit_to")
    @classmethod
    def _aware(cls, v: datetime | None) -> datetime | None:
        return v.replace(tzinfo=UTC) if v is not None and v.tzinfo is None else v

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if bool(self.topics) == bool(self.topic_pattern):
            raise ValueError("give the delivered topics either by name or by pattern")
        if self.marker_topic in self.topics:
            raise ValueError("the op-marker topic is not a delivered topic")
        if self.marker_topic in self.not_deliveries:
            # its records dropped, every copy was a record without its marker
            raise ValueError(
                f"the op-marker topic {self.marker_topic!r} cannot be ignored (--ignore-topic, "
                "--dead-letter-topic): its markers are what is judged, and a pattern that "
                "matches it takes none of its records for deliveries"
            )
        for name in self.former_outbox_names:
            database, slash, schema = name.rpartition("/")
            if not (database and slash and schema):
                raise ValueError(
                    f'--former-outbox-name {name!r} is not "<database>/<schema>" (as the '
                    "relay names an outbox in its markers, e.g. app/outbox)"
                )
        if (self.audit_from is None) != (self.audit_to is None):
            raise ValueError("an audit needs both --from and --to")
        if self.audit_from is not None and self.audit_to is not None:
            if self.audit_from >= self.audit_to:
                raise ValueError("--from must be before --to")
        elif self.checkpoint is None:
            raise ValueError("a streaming run needs a checkpoint location")
        if self.undelivered_deadline is not None and self.undelivered_deadline < self.deadline:
            raise ValueError(
                f"--undelivered-deadline ({format_duration(self.undelivered_deadline)}) must "
                f"not be shorter than --deadline ({format_duration(self.deadline)})"
            )
        if self.horizon < 2 * self.deadline + 2 * self.trigger:
            raise ValueError("the horizon must cover two deadlines and two trigger intervals")
        if self.summary_window > self.horizon - 2 * self.deadline:
            # the summary window holding the last judged time then began before the horizon:
            # every judgement until its end was one of the whole horizon, no late arrival judged
            raise ValueError(
                f"the summary window ({format_duration(self.summary_window)}) must fit in the "
                f"horizon less two deadlines ({format_duration(self.horizon - 2 * self.deadline)})"
                ": raise --horizon"
            )
        if self.findings_retention is not None and self.findings_retention <= self.horizon:
            raise ValueError(
                f"the findings retention ({format_duration(self.findings_retention)}) must be "
                f"longer than the horizon ({format_duration(self.horizon)}): a record is "
                "re-judged while inside the horizon"
            )
        return self

    @property
    def audit(self) -> bool:
        return self.audit_from is not None

    @property
    def undelivered_after(self) -> timedelta:
        """How long a record waits for the relay before it is reported (undelivered_deadline)."""
        if self.undelivered_deadline is not None:
            return self.undelivered_deadline
        return max(self.deadline, DEFAULT_UNDELIVERED_DEADLINE)

    @property
    def not_deliveries(self) -> tuple[str, ...]:
        """Topics a pattern may match whose records are not deliveries: none judged."""
        return (self.dead_letter_topic, *self.ignored_topics)

    def kafka_source_options(self) -> dict[str, str]:
        """Options of Spark's Kafka source shared by the streaming and the audit reads."""
        # A transactional producer's last offset is a commit marker, not a record: the source's
        # read of each partition ended waiting for a fetch past it, which the broker holds for
        # fetch.max.wait.ms (500 ms by default) when nothing follows. A task reads its
        # partitions one after another: 50k records took 2.2 s to read and store, 1.2 s with
        # this. The source reads ranges it knows exist, so it needs no long poll. A
        # --kafka-option wins.
        options = {"kafka.fetch.max.wait.ms": str(SOURCE_FETCH_MAX_WAIT_MS)}
        options.update({f"kafka.{k}": v for k, v in self.kafka_options.items()})
        options.update(
            {
                "kafka.bootstrap.servers": self.bootstrap_servers,
                # only committed Kafka transactions: what a read_committed consumer sees
                "kafka.isolation.level": "read_committed",
                "includeHeaders": "true",
            }
        )
        if self.topic_pattern:
            # the op markers come through the same source; \Q..\E quotes the name as it is.
            # Anchored: Spark's source took a topic the pattern matched only part of.
            options["subscribePattern"] = f"^(?:{self.topic_pattern})$|^\\Q{self.marker_topic}\\E$"
        else:
            options["subscribe"] = ",".join([*self.topics, self.marker_topic])
        return options

    def jdbc(self) -> tuple[str, dict[str, str]]:
        url, props = jdbc_target(self.dsn.get_secret_value(), self.jdbc_url)
        # A database gone silent (failed, partitioned, failed over) sends no reset: without it
        # a ledger read waited for ever, the job reporting nothing and its process alive. A
        # socketTimeout in --jdbc-url wins (the driver takes the URL's over these).
        props["socketTimeout"] = str(math.ceil(self.jdbc_read_timeout.total_seconds()))
        return url, props


def _floor(t: datetime, size: timedelta) -> datetime:
    """The start of the summary window (aligned to the epoch, as Spark's window()) holding t."""
    epoch = datetime(1970, 1, 1, tzinfo=t.tzinfo or UTC)
    return t - (t - epoch) % size


@dataclass(frozen=True)
class JudgeWindow:
    """Which records one judgement may decide, and with what the store holds (module docstring).

    `include_stuck`: also report ledger rows still `committed` from before `lo` (a streaming job
    must, or a relay that stopped longer than the horizon goes unreported; an audit of a past
    window must not).
    """

    as_of: datetime
    store_low: datetime
    lo: datetime
    hi: datetime
    include_stuck: bool
    windows_from: datetime | None = None  # summary windows starting here or later (None: lo)
    # the job holds the histograms of the summary windows open at lo (see following())
    latency_carried: bool = False

    @classmethod
    def streaming(cls, as_of: datetime, deadline: timedelta, horizon: timedelta) -> Self:
        store_low = as_of - horizon
        return cls(as_of, store_low, store_low + deadline, as_of - deadline, include_stuck=True)

    @classmethod
    def following(
        cls,
        judged_to: datetime | None,
        as_of: datetime,
        deadline: timedelta,
        horizon: timedelta,
        summary_window: timedelta,
        latency_from: datetime | None = None,
    ) -> Self:
        """The next judgement of a running job that judged up to `judged_to` before.

        It decides what became due since, with one deadline of observations before that as the
        context, instead of the whole horizon: the cost of a judgement follows the traffic since
        the last one, not the horizon. What the last judgements decided is not decided again: an
        observation whose Kafka time is older than its arrival is judged by the first judgement
        a deadline (and a trigger) after the micro-batch that read it (ReconcileJob.judge marks
        it LATE_JUDGED), however late it is. Without an earlier judgement inside the horizon (a
        start, a restart) it judges the whole horizon.

        The summary window still open at `judged_to` is emitted once it closes. When it begins
        at `latency_from` or later, the job holds the latency histogram of its copies up to
        `judged_to` (spark/latency.py: every copy since `latency_from`); otherwise the context
        reaches back to the window's start, to count them again.
        """
        full = cls.streaming(as_of, deadline, horizon)
        if judged_to is None or judged_to <= full.lo:
            return full
        lo = judged_to
        # Never back before what was judged (a restart with a longer deadline, a driver whose
        # clock is behind): the next window counted the copies since then into the carried
        # summary windows a second time.
        hi = max(as_of - deadline, lo)
        windows_from = _floor(judged_to, summary_window)
        if latency_from is not None and windows_from >= latency_from:
            return cls(as_of, lo - deadline, lo, hi, True, windows_from, True)
        if windows_from < full.store_low:  # not all of it is in the store any more
            return full
        store_low = min(lo - deadline, windows_from)
        return cls(as_of, store_low, lo, hi, True, windows_from)

    @classmethod
    def audit(cls, start: datetime, end: datetime, now: datetime, deadline: timedelta) -> Self:
        as_of = min(end + deadline, now)
        hi = min(end, as_of - deadline)
        if hi <= start:
            raise ReconcileConfigError(
                f"nothing to audit yet: records after {hi.isoformat()} are not due until the "
                f"deadline ({format_duration(deadline)}) has passed"
            )
        return cls(as_of, start - deadline, start, hi, include_stuck=False)

    @property
    def empty(self) -> bool:
        return self.hi <= self.lo

    @property
    def summaries_from(self) -> datetime:
        return self.lo if self.windows_from is None else self.windows_from

    def as_dict(self) -> dict[str, Any]:
        return {
            "as_of": self.as_of.isoformat(),
            "lo": self.lo.isoformat(),
            "hi": self.hi.isoformat(),
        }
