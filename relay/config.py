"""Configuration of the sidecar process (relay and checker), with pydantic-settings.

Sources, highest priority first: constructor arguments, environment variables (prefix
`OUTBOX_`, nested with `__`, e.g. `OUTBOX_KAFKA__BOOTSTRAP_SERVERS`, `OUTBOX_RELAY__BATCH_SIZE`),
secrets mounted as files named like those variables (`OUTBOX_SECRETS_DIR`, default
`/run/secrets/outbox` when it exists; e.g. a file `outbox_database__dsn`), then a TOML config
file (`--config` or `OUTBOX_CONFIG_FILE`). Nothing is read at import time: call
`load_settings()`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tomllib
from datetime import timedelta
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Self, TypeVar, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NestedSecretsSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from checker.config import CheckerSettings
from outbox._core import OutboxConfig
from outbox._dsn import MASK, check_dsn_setting, masked_dsn
from outbox._errors import InvalidTopicError
from outbox._records import check_topic
from relay.durations import Duration, iso_days
from relay.markers import MARKER_MESSAGE_MARGIN

DEFAULT_SECRETS_DIR = Path("/run/secrets/outbox")
# OUTBOX_* variables that are not settings: the commands' own, and the project's scripts' and tests'
_NOT_SETTINGS = {
    "OUTBOX_CONFIG_FILE", "OUTBOX_SECRETS_DIR", "OUTBOX_DATABASE_URL", "OUTBOX_SPARK_JARS",
    "OUTBOX_RELAY_FAILPOINT", "OUTBOX_LOCAL_DIR", "OUTBOX_PG_PORT", "OUTBOX_PGBOUNCER_PORT",
    "OUTBOX_KAFKA_PORT", "OUTBOX_KAFKA_CONTROLLER_PORT", "OUTBOX_KAFKA_SASL_PORT",
    "OUTBOX_KAFKA_SSL_PORT", "OUTBOX_KUBE_PORT", "OUTBOX_ETCD_PORT", "OUTBOX_DEBIAN_MIRROR",
}  # fmt: skip
_NOT_SETTINGS_PREFIXES = ("OUTBOX_TEST_",)
# what Kubernetes sets for each Service of the namespace (service links), for a Service named
# outbox-... (the chart's own is <release>-outbox-sidecar): OUTBOX_..._SERVICE_HOST and the like
_SERVICE_LINK = re.compile(
    r"_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)
_warned_unknown: set[str] = set()

logger = logging.getLogger(__name__)


# librdkafka properties that hold secrets: *.password, *.secret, PEM keys, OAUTHBEARER configs,
# key passphrases (sasl.oauthbearer.assertion.private.key.passphrase)
_SECRET_PROPERTY = re.compile(
    r"password|passphrase|secret|pem|oauthbearer\.config|token|credential", re.I
)


class KafkaSettings(BaseModel):
    """librdkafka settings as a typed model; `to_librdkafka()` renders the client dict.

    Secrets are `SecretStr`: masked in repr, logs and `outboxctl config`. Anything not modelled
    here goes through `extra` unchanged (librdkafka validates it when the client is created).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    bootstrap_servers: str = Field(default="127.0.0.1:9092", min_length=1)
    client_id: str = "outbox-sidecar"
    security_protocol: Literal["plaintext", "ssl", "sasl_plaintext", "sasl_ssl"] = "plaintext"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_ca_location: str | None = None
    ssl_certificate_location: str | None = None
    ssl_key_location: str | None = None
    ssl_key_password: SecretStr | None = None
    extra: dict[str, str | int | float | bool] = Field(
        default_factory=dict,
        description="Further librdkafka properties, passed through.",
        repr=False,  # may hold secrets; `outboxctl config` shows it masked (_masked_extra)
    )

    @field_validator("security_protocol", mode="before")
    @classmethod
    def _protocol_any_case(cls, v: Any) -> Any:
        return v.lower() if isinstance(v, str) else v  # Kafka's docs write SASL_SSL

    @field_validator("sasl_mechanism", mode="before")
    @classmethod
    def _mechanism_any_case(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _logins_the_protocol_uses(self) -> Self:
        """A SASL login or TLS files under a protocol that uses none were dropped, unsaid
        (librdkafka warns in its log, once): the client connected without them."""
        in_extra = "security.protocol" in self.extra  # there, it wins (to_librdkafka)
        protocol = str(self.extra.get("security.protocol", self.security_protocol)).lower()
        given = [f for f in type(self).model_fields if f != "extra" and getattr(self, f)]
        sasl = [f for f in given if f.startswith("sasl_")] if "sasl" not in protocol else []
        ssl = [f for f in given if f.startswith("ssl_")] if "ssl" not in protocol else []
        if sasl or ssl:
            wanted = "sasl" in protocol or sasl, "ssl" in protocol or ssl
            fix = {(True, True): "sasl_ssl", (True, False): "sasl_ssl or sasl_plaintext"}.get(
                (bool(wanted[0]), bool(wanted[1])), "ssl"
            )
            raise ValueError(
                f"kafka.{', kafka.'.join(sasl + ssl)}: not used with security_protocol "
                f"{protocol}; set "
                + ("kafka.extra's security.protocol" if in_extra else "security_protocol")
                + f" to {fix}"
            )
        return self

    @field_serializer("extra")
    def _masked_extra(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {k: MASK if _SECRET_PROPERTY.search(k) else v for k, v in extra.items()}

    def to_librdkafka(self) -> dict[str, Any]:
        conf: dict[str, Any] = {
            "bootstrap.servers": self.bootstrap_servers,
            "client.id": self.client_id,
            "security.protocol": self.security_protocol,
        }
        optional = {
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password,
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.certificate.location": self.ssl_certificate_location,
            "ssl.key.location": self.ssl_key_location,
            "ssl.key.password": self.ssl_key_password,
        }
        for name, value in optional.items():
            if value is not None:
                conf[name] = value.get_secret_value() if isinstance(value, SecretStr) else value
        conf.update(self.extra)
        return conf


class DatabaseSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    dsn: SecretStr = Field(
        min_length=1, description="libpq connection string of the application's database."
    )
    schema_name: str = Field(default="outbox", description="Schema of the outbox tables.")
    connect_timeout_s: float = Field(default=10.0, gt=0, le=3600, allow_inf_nan=False)
    transaction_pooling: bool = Field(
        default=False,
        description="The DSN goes through a pooler in transaction pooling (PgBouncer's "
        "pool_mode=transaction): no prepared statements (another client's server connection "
        "has them, or lacks ours) and no LISTEN (relay.listen_notify off: poll only).",
    )

    def connect_options(self) -> dict[str, Any]:
        """psycopg.connect's options these settings ask for, beyond the DSN."""
        return {"prepare_threshold": None} if self.transaction_pooling else {}

    @field_validator("schema_name")
    @classmethod
    def _identifier(cls, v: str) -> str:
        return OutboxConfig(schema_name=v).schema_name

    @field_validator("dsn")
    @classmethod
    def _parses(cls, v: SecretStr) -> SecretStr:
        return check_dsn_setting(v, "database.dsn")

    @field_serializer("dsn", when_used="json")
    def _shown(self, v: SecretStr | None) -> str | None:
        """Host, port, database and user shown (`outboxctl config`), the password masked."""
        return None if v is None else masked_dsn(v.get_secret_value())


class HttpSettings(BaseModel):
    """Where /healthz, /readyz and /metrics listen."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    host: str = "0.0.0.0"  # noqa: S104 - the probes come from the kubelet, outside the pod
    port: int = Field(default=8080, ge=0, le=65535)
    enabled: bool = True


MIN_OP_MARKER_MESSAGE_BYTES = 1024
LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000  # librdkafka's default message.max.bytes


class RelaySettings(BaseModel):
    """The relay's own knobs; defaults chosen with bench/relay.py."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    enabled: bool = True
    relay_id: str | None = Field(
        default=None,
        max_length=200,  # the payload of its wake-ups (relay_wake_relays): at most 8000 bytes
        description="Identity in leases and logs; default: host name and pid.",
    )
    shards: int = Field(default=1, ge=1, le=1024, description="Shards of the outbox, by key hash.")
    transactional_id_prefix: str = Field(
        default="outbox-relay", min_length=1, description="transactional.id = <prefix>-<shard>."
    )
    recovery_group_prefix: str = Field(
        default="outbox-relay-recovery-",
        min_length=1,
        description="A recovery's consumer of the op markers is named a group with this "
        "prefix and a random suffix, as Kafka's Python client requires. It reads by assignment "
        "and commits nothing: no group ACL is needed.",
    )
    op_marker_topic: str = "outbox.op-markers"
    op_marker_partitions: int = Field(default=4, ge=1)
    op_marker_retention: Duration = Field(
        default=timedelta(days=7),
        # the markers are what a recovery reads: shorter, an ordinary outage outlived them, and
        # an idle shard's recorded offset (moved on every hour) fell behind them while it ran
        ge=timedelta(days=1),
        description="retention.ms of the op-marker topic the relay creates; at least a day.",
    )
    op_marker_message_bytes: int = Field(
        default=256 * 1024,
        ge=MIN_OP_MARKER_MESSAGE_BYTES,
        description="Markers per op-marker message, in bytes: below the topic's max.message.bytes.",
    )
    dead_letter_topic: str = "outbox.dead-letter"
    batch_size: int = Field(default=1000, ge=1, le=100_000)
    batch_max_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1,
        description="A claim stops taking transactions once their keys, values and headers "
        "reach this many bytes (a transaction whole, however large): the relay holds a batch "
        "in memory, and librdkafka a copy. By count alone, 1,000 records of 300 KB took 636 MB.",
    )
    linger: Duration = Field(
        default=timedelta(milliseconds=0),
        ge=timedelta(0),
        description="Wait this long to fill a batch.",
    )
    poll_interval: Duration = Field(
        default=timedelta(milliseconds=500),
        gt=timedelta(0),  # 0: rounds back to back, with nothing to do
        description="Polling fallback between wake-ups.",
    )
    listen_notify: bool = Field(
        default=True, description="LISTEN for commits; off for PgBouncer transaction pooling."
    )
    claim_ahead: bool = Field(
        default=True,
        description="In a drain, claim the next batch on a connection of its own while a full "
        "batch waits for Kafka (one Postgres connection more; drains ~10% faster on a 2-core "
        "machine with Postgres and Kafka beside the relay, README).",
    )
    lease_duration: Duration = Field(default=timedelta(seconds=15), gt=timedelta(0))
    heartbeat_interval: Duration = Field(default=timedelta(seconds=5), ge=timedelta(0))
    delivered_retention: Duration = Field(
        default=timedelta(0),
        ge=timedelta(0),
        description="Keep delivered rows this long (0: delete at once).",
    )
    audit_retention: Duration = Field(
        default=timedelta(days=90),
        ge=timedelta(0),
        description="Keep audit_log entries (commands run by hand, discards) this long "
        "(0: for ever).",
    )
    kafka_transaction_timeout: Duration = Field(
        default=timedelta(seconds=60),
        ge=timedelta(seconds=1),  # librdkafka's least transaction.timeout.ms
        description="Kafka's transaction.timeout.ms, and how long the relay waits on Kafka "
        "for a batch's reports, commit or abort (kafka.extra may set the first apart: the "
        "relay's waits then end at the shorter of the two).",
    )
    # at least a second: with none, no stop could end within it, every SIGTERM exited 1 and
    # the shards were left to expire
    shutdown_grace: Duration = Field(default=timedelta(seconds=25), ge=timedelta(seconds=1))

    @field_validator("op_marker_topic", "dead_letter_topic")
    @classmethod
    def _a_kafka_topic_name(cls, topic: str) -> str:
        # Else the broker refused to make it, and the relay retried that for ever.
        try:
            return check_topic(topic)
        except InvalidTopicError as exc:
            raise ValueError(str(exc)) from None

    @model_validator(mode="after")
    def _dead_letters_apart_from_the_markers(self) -> Self:
        # A recovery reads every message of the marker topic as markers: a dead-letter copy
        # there failed every recovery's decoding, and one shaped as markers ended rows unsent.
        if self.dead_letter_topic == self.op_marker_topic:
            raise ValueError(
                f"dead_letter_topic and op_marker_topic are both {self.op_marker_topic!r}: "
                "recovery reads every message of the op-marker topic as op markers; give the "
                "dead-letter copies a topic of their own"
            )
        return self

    @model_validator(mode="after")
    def _heartbeats_fit_the_lease(self) -> Self:
        # A lease renewed no sooner than it expires is taken by another relay between two
        # heartbeats, and taken back: epochs bump, producers are fenced, over and over.
        if self.heartbeat_interval * 2 >= self.lease_duration:
            raise ValueError(
                f"heartbeat_interval ({iso_days(self.heartbeat_interval)}) must be under half "
                f"of lease_duration ({iso_days(self.lease_duration)}): a lease must be renewed "
                "before it can expire, with room for a slow round"
            )
        return self


class _FromEverywhere(BaseSettings):
    """Settings read from the environment, mounted secrets and an optional TOML file."""

    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_",
        env_nested_delimiter="__",
        secrets_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        hide_input_in_errors=True,  # a mistyped secret's name must not print its value
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # each folding the checker's endpoint names (_fold_endpoints)
        sources: list[PydanticBaseSettingsSource] = [init_settings, _FoldedEnv(settings_cls)]
        sources.append(_FoldedSecrets(file_secret_settings))
        if settings_cls.model_config.get("toml_file"):  # set by load_settings
            sources.append(_FoldedToml(settings_cls))
        return tuple(sources)


def _fold_endpoints(data: dict[str, Any]) -> dict[str, Any]:
    """A source's settings with the checker's endpoint names case-folded, before the sources are
    merged. Environment variables and secret file names reach the settings lower-cased, while
    the config file and a JSON value keep the case: `OrderService` in the file and
    `orderservice` from a secret file were two endpoints. Folded in each source, one endpoint
    from two sources merges by the sources' priority (environment, secret files, the file)."""
    checker = data.get("checker")
    if not isinstance(checker, dict) or not isinstance(checker.get("endpoints"), dict):
        return data
    folded: dict[str, Any] = {}
    for name, endpoint in checker["endpoints"].items():
        key = str(name).casefold()
        if key in folded:
            raise SettingsError(
                f"checker.endpoints: {key!r} is given twice in one place, in two cases: "
                "producer groups match endpoints whatever the case; give it once"
            )
        folded[key] = endpoint
    return {**data, "checker": {**checker, "endpoints": folded}}


class _FoldedEnv(EnvSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _fold_endpoints(super().__call__())


class _FoldedSecrets(NestedSecretsSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _fold_endpoints(super().__call__())

    @classmethod
    def load_secrets(cls, path: Path) -> dict[str, str]:
        """The outbox_* files only: the Secret mounted there may hold a TLS setup's files too (a
        PKCS#12 keystore, a DER certificate), and pydantic-settings read every file as text:
        one not UTF-8 failed every command's start."""
        found: dict[str, str] = {}
        # The directory's own entries (a Secret's volume links each key to ..data/<key>; its
        # hidden entries are not keys), walked here: pydantic-settings' walk is its own.
        for file in sorted(path.iterdir()):
            if not file.name.lower().startswith("outbox_") or not file.is_file():
                continue
            try:
                found[file.name] = file.read_text(encoding="utf-8").strip()
            except UnicodeDecodeError:
                raise SettingsError(f"the secret file {file} is not UTF-8 text") from None
        return found


class _FoldedToml(TomlConfigSettingsSource):
    def __call__(self) -> dict[str, Any]:
        return _fold_endpoints(super().__call__())


class SidecarSettings(_FromEverywhere):
    """Everything the sidecar process reads at start."""

    database: DatabaseSettings
    kafka: KafkaSettings = KafkaSettings()
    http: HttpSettings = HttpSettings()
    relay: RelaySettings = RelaySettings()
    checker: CheckerSettings = CheckerSettings()
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["json", "text"] = "json"
    on_part_stopped: Literal["exit", "retry"] = Field(
        default="exit",
        description="When the relay or the checker stops on something that cannot work (a "
        "schema not migrated, a setting the broker refuses): exit 1, to be restarted with the "
        "error in the log; or retry: the process stays up (/healthz alive, /readyz not ready, "
        "outbox_sidecar_part_stopped 1) and starts the part again every part_retry_interval. "
        "The chart's sidecar mode retries: a sidecar that exits takes its application's pod "
        "out of its Service.",
    )
    part_retry_interval: Duration = Field(
        default=timedelta(seconds=60), ge=timedelta(seconds=1), le=timedelta(hours=1)
    )

    @model_validator(mode="after")
    def _poll_only_through_a_pooler(self) -> Self:
        """A pooler in transaction pooling gives each transaction any server connection, so a
        LISTEN hears nothing: the relay polls. Said, not silently dropped, when asked for."""
        if self.database.transaction_pooling and self.relay.listen_notify:
            if "listen_notify" in self.relay.model_fields_set and self.relay.enabled:
                raise ValueError(
                    "relay.listen_notify = true cannot work with database.transaction_pooling: "
                    "a LISTEN through a transaction pooler hears nothing; leave listen_notify "
                    "unset (the relay polls, every relay.poll_interval)"
                )
            # frozen models: set during validation, as pydantic itself sets fields
            object.__setattr__(
                self, "relay", self.relay.model_copy(update={"listen_notify": False})
            )
        return self

    @model_validator(mode="after")
    def _markers_fit_the_producers_messages(self) -> Self:
        """The producer's side of the op-marker message limit needs no broker: refused here,
        by `outboxctl config` too, not at the relay's start (the topic's side is checked there)."""
        given = self.kafka.extra.get("message.max.bytes", LIBRDKAFKA_MESSAGE_MAX_BYTES)
        try:
            limit = int(given)
        except ValueError:
            return self  # not a number: the Kafka client says so
        name = "the producer's message.max.bytes (kafka.extra)"
        if self.relay.enabled and (why := marker_size_refused(self.relay, name, limit)):
            raise ValueError(why)
        return self

    @field_validator("log_level", "log_format", "on_part_stopped", mode="before")
    @classmethod
    def _any_case(cls, v: Any, info: ValidationInfo) -> Any:
        if not isinstance(v, str):
            return v
        return v.upper() if info.field_name == "log_level" else v.lower()


def marker_size_refused(relay: RelaySettings, name: str, limit: int) -> str | None:
    """Why relay.op_marker_message_bytes cannot work under `limit` (`name`'s), or None."""
    needed = relay.op_marker_message_bytes + MARKER_MESSAGE_MARGIN
    if needed <= limit:
        return None
    fits = limit - MARKER_MESSAGE_MARGIN
    fix = (
        f"set it to at most {fits}"
        if fits >= MIN_OP_MARKER_MESSAGE_BYTES
        else f"raise {name} to at least {needed}"  # below the setting's least: refused too
    )
    return (
        f"relay.op_marker_message_bytes is {relay.op_marker_message_bytes}, but {name} is "
        f"{limit}: {fix} (a message may exceed it by one entry and the envelope, "
        f"{MARKER_MESSAGE_MARGIN} bytes at most)"
    )


class DatabaseLookupSettings(DatabaseSettings):
    """The database setting as the inspection commands read it: their DSN may come from --dsn
    or OUTBOX_DATABASE_URL instead, and the schema and connect timeout still come from here (a
    DSN from --dsn dropped the schema setting, unsaid: `status` read another outbox)."""

    dsn: SecretStr | None = None  # type: ignore[assignment]

    @field_validator("dsn")
    @classmethod
    def _parses(cls, v: SecretStr | None) -> SecretStr | None:  # type: ignore[override]
        return None if v is None else check_dsn_setting(v, "database.dsn")


class DatabaseOnlySettings(_FromEverywhere):
    """The database part of the sidecar's settings, the rest unread: what `outboxctl migrate`
    and the inspection commands need. The chart's migration Job mounts the Secret alone (its
    hook runs before the ConfigMap exists), and a checker endpoint's secret there, without the
    endpoint's url from the config, failed the whole sidecar's settings."""

    model_config = SettingsConfigDict(extra="ignore")

    database: DatabaseLookupSettings = DatabaseLookupSettings()


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> SidecarSettings:
    """Read the settings from the environment, mounted secrets and an optional TOML file."""
    return _load(SidecarSettings, config_file, overrides)


def load_database_settings(config_file: str | Path | None = None) -> DatabaseOnlySettings:
    """load_settings() of the database part alone."""
    return _load(DatabaseOnlySettings, config_file, {})


_S = TypeVar("_S", bound=_FromEverywhere)


def _warn_unknown_names(secrets_dir: str | None) -> None:
    """pydantic-settings skips an environment variable or secret file whose first part names no
    setting (OUTBOX_LOG_LEVL, OUTBOX_KAFKA_BOOTSTRAP_SERVERS with one underscore, a secret file
    outbox_kafka_sasl_password): the setting kept its default, unsaid. Said once each, not
    refused: other tools may set OUTBOX_* variables of their own."""
    sections = set(SidecarSettings.model_fields)
    found = [(n, "environment variable") for n in os.environ if n.upper().startswith("OUTBOX_")]
    if secrets_dir and Path(secrets_dir).is_dir():
        found += [
            (p.name, f"secret file in {secrets_dir}")
            for p in Path(secrets_dir).iterdir()
            if p.name.lower().startswith("outbox_")
        ]
    for name, where in found:
        upper = name.upper()
        if upper in _NOT_SETTINGS or upper.startswith(_NOT_SETTINGS_PREFIXES):
            continue
        if where == "environment variable" and _SERVICE_LINK.search(upper):
            continue
        section = upper.removeprefix("OUTBOX_").split("__")[0].lower()
        if section in sections or name in _warned_unknown:
            continue
        _warned_unknown.add(name)
        logger.warning(
            "%s %s is not a setting and is ignored: settings are OUTBOX_ and one of %s, parts "
            "joined by __ (e.g. OUTBOX_KAFKA__BOOTSTRAP_SERVERS)",
            where,
            name,
            ", ".join(sorted(s.upper() for s in sections)),
        )


class SettingsUnreadable(ValueError):
    """The settings could not be read at all: a config file that is not TOML, a value in the
    environment that is not the JSON its setting takes."""


_SOURCES = {
    "_FoldedEnv": "the environment variable OUTBOX_{FIELD} (or an OUTBOX_{FIELD}__...)",
    "_FoldedSecrets": "the secret file outbox_{field} (or an outbox_{field}__...)",
    "_FoldedToml": "the config file's [{field}]",
}


def _where(exc: SettingsError) -> str:
    """pydantic-settings' 'error parsing value for field "kafka" from source "_FoldedEnv"', said
    as the operator set it: the variable OUTBOX_KAFKA__<...>, not a class of ours."""
    found = re.search(r'field "(\w+)" from source "(\w+)"', str(exc))
    if found is None or found.group(2) not in _SOURCES:
        return str(exc)
    field, source = found.groups()
    named = _SOURCES[source].format(field=field, FIELD=field.upper())
    if source == "_FoldedEnv":  # the one that is not JSON, where a setting takes JSON
        culprits = [
            name
            for name, value in os.environ.items()
            if name.upper().startswith(f"OUTBOX_{field.upper()}")
            and _takes_json(SidecarSettings, name.upper().removeprefix("OUTBOX_").split("__"))
            and not _is_json(value)
        ]
        if culprits:
            named = f"the environment variable {', '.join(sorted(culprits))} (JSON expected)"
    return f"{named} cannot be read"


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _takes_json(model: type[BaseModel], path: list[str]) -> bool:
    """Whether the setting at `path` (an environment variable's parts) is a list, a mapping or a
    section, which pydantic-settings reads from the environment as JSON."""
    annotation: Any = model
    for part in path:
        annotation = _unwrapped(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part.lower())
            if field is None:
                return False
            annotation = field.annotation
        elif get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]  # `part` is a key of the mapping
        else:
            return False
    annotation = _unwrapped(annotation)
    return get_origin(annotation) in (list, dict, tuple, set) or (
        isinstance(annotation, type) and issubclass(annotation, BaseModel)
    )


def _unwrapped(annotation: Any) -> Any:
    """X of `X | None` and of `Annotated[X, ...]`."""
    while True:
        if get_origin(annotation) is Annotated:
            annotation = get_args(annotation)[0]
        elif get_origin(annotation) in (Union, UnionType):
            kept = [a for a in get_args(annotation) if a is not type(None)]
            if len(kept) != 1:
                return annotation
            annotation = kept[0]
        else:
            return annotation


def _load(kind: type[_S], config_file: str | Path | None, overrides: dict[str, Any]) -> _S:
    secrets_dir = os.environ.get("OUTBOX_SECRETS_DIR") or (
        str(DEFAULT_SECRETS_DIR) if DEFAULT_SECRETS_DIR.is_dir() else None
    )
    config_file = config_file or os.environ.get("OUTBOX_CONFIG_FILE")
    chosen: type[_S] = kind
    if config_file:
        path = Path(config_file)
        if not path.is_file():
            what = "is a directory" if path.is_dir() else "does not exist"
            raise FileNotFoundError(f"config file {path} {what}")

        class FromFile(kind):  # type: ignore[valid-type,misc]
            model_config = SettingsConfigDict(toml_file=path)

        chosen = FromFile
    _warn_unknown_names(secrets_dir)
    try:
        return chosen(_secrets_dir=secrets_dir, **overrides)
    except tomllib.TOMLDecodeError as exc:  # it named no file
        raise SettingsUnreadable(f"config file {config_file} is not TOML: {exc}") from None
    except UnicodeDecodeError:  # TOML is UTF-8; it named no file either
        raise SettingsUnreadable(f"config file {config_file} is not UTF-8 text") from None
    except OSError as exc:  # a file of the secrets or the config the process may not read
        raise SettingsUnreadable(
            f"{exc.filename or config_file} cannot be read: {exc.strerror}"
        ) from None
    except SettingsError as exc:  # e.g. OUTBOX_KAFKA__EXTRA not JSON; it names the setting
        why = f": {exc.__cause__}" if exc.__cause__ else ""  # where the JSON broke, no value
        raise SettingsUnreadable(f"{_where(exc)}{why}") from None
