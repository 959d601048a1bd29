"""Kafka client properties for the job's Kafka source: a properties file, as Kafka's own tools
take one (`kafka-console-consumer --consumer.config`), and the checks Spark's source would
otherwise make only when a query starts.

A file keeps secrets (`sasl.jaas.config`, `ssl.keystore.password`) off the command line, where
`ps` and a pod's spec show them: the chart mounts it from a Secret.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from spark._errors import ReconcileConfigError

# Spark's Kafka source refuses these: it deserializes, keeps offsets and commits itself.
# (group.id passes: Spark only warns, and a cluster's ACLs may require one.)
REFUSED = {
    "auto.offset.reset": "the job starts from its checkpoint, else the earliest offsets",
    "enable.auto.commit": "Spark keeps the offsets in its checkpoint",
    "key.deserializer": "Spark reads keys as bytes",
    "value.deserializer": "Spark reads values as bytes",
    "interceptor.classes": "Spark's Kafka source refuses interceptors",
}
# bootstrap.servers: --bootstrap, else the file's; isolation.level: the job's, read_committed.
BOOTSTRAP = "bootstrap.servers"
ISOLATION = "isolation.level"


def refused_option(key: str, value: str) -> str | None:
    """Why the Kafka consumer property cannot be given to the job, or None when it can."""
    if key in REFUSED:
        return f"{key} cannot be set: {REFUSED[key]}"
    if key == ISOLATION and value.strip().lower() != "read_committed":
        return f"{ISOLATION} must be read_committed (only committed Kafka transactions count)"
    if not key or key.startswith("kafka."):
        return f"{key!r} is not a Kafka consumer property (write them without Spark's 'kafka.')"
    return None


def load(path: str) -> dict[str, str]:
    """The properties of a Kafka client properties file; ReconcileConfigError names the file.

    Read as ISO-8859-1, as Kafka's tools read theirs (`Properties.load(InputStream)`): a file
    that works with them means the same here (write other characters as \\uXXXX).
    """
    try:
        import javaproperties  # the `spark` extra; a full parser of Java's format
    except ImportError:
        raise ReconcileConfigError(
            f"--kafka-config {path}: reading it needs the javaproperties package "
            "(install kafka-outbox-sidecar[spark])"
        ) from None
    file = Path(path)
    if file.is_dir():
        raise ReconcileConfigError(f"--kafka-config {path}: is a directory, not a properties file")
    try:
        with file.open(encoding="iso-8859-1") as fp:
            properties: Mapping[str, str] = javaproperties.load(fp)
    except OSError as exc:
        raise ReconcileConfigError(f"--kafka-config {path}: {exc.strerror or exc}") from None
    except ValueError:  # a bad \u escape: its text may be part of a password, not shown
        raise ReconcileConfigError(
            f"--kafka-config {path}: a \\u escape is malformed (write \\u and four hex digits)"
        ) from None
    return dict(properties)
