"""What a soak runs on: its own stack, database, topics and relay settings."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "scripts" / "services.py"
# The virtualenv's console script beside the interpreter running the soak.
OUTBOXCTL = Path(sys.executable).with_name("outboxctl")

HOST = "127.0.0.1"
KEYS = tuple(f"k{i:02d}" for i in range(50))
# Two topics of different partition counts: a key's records land on one partition of one topic.
TOPICS = {"soak.a": 3, "soak.b": 2}
MARKER_TOPIC = "soak.op-markers"
DEAD_LETTER_TOPIC = "soak.dead-letter"
PRODUCER_GROUP = "soak"
SHARDS = 6  # more shards than relays: leases move between relays under the chaos
# Short leases so that a SIGSTOP of 8-25 s outlives one and another relay takes the shard over.
LEASE = "PT6S"


def topic_of(key: str) -> str:
    return "soak.a" if int(key[1:]) % 2 == 0 else "soak.b"


@dataclass(frozen=True)
class Settings:
    """Ports and directory of the soak's stack: beside the developer's (55432/59092/59093,
    `.local/`), never on it."""

    pg_port: int = 56432
    kafka_port: int = 60092
    controller_port: int = 60093
    local_dir: Path = field(default=ROOT / ".local" / "soak")
    database: str = "soak"

    @property
    def admin_dsn(self) -> str:
        return f"postgresql://postgres@{HOST}:{self.pg_port}/postgres"

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@{HOST}:{self.pg_port}/{self.database}"

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.kafka_port}"

    @property
    def outbox_name(self) -> str:
        """How the relay's op markers name this outbox: `<database>/<schema>`."""
        return f"{self.database}/outbox"

    def service_env(self) -> dict[str, str]:
        """The environment of `scripts/services.py` for the soak's stack."""
        return {
            **os.environ,
            "OUTBOX_LOCAL_DIR": str(self.local_dir),
            "OUTBOX_PG_PORT": str(self.pg_port),
            "OUTBOX_KAFKA_PORT": str(self.kafka_port),
            "OUTBOX_KAFKA_CONTROLLER_PORT": str(self.controller_port),
            # its SASL listeners beside its broker's port, whatever the caller exported
            "OUTBOX_KAFKA_SASL_PORT": str(self.kafka_port + 2),
            "OUTBOX_KAFKA_SSL_PORT": str(self.kafka_port + 3),
        }

    def relay_env(self, relay_id: str) -> dict[str, str]:
        """`outboxctl relay`'s environment: none of the caller's OUTBOX_ settings leak in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(
            {
                "OUTBOX_DATABASE__DSN": self.dsn,
                "OUTBOX_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap,
                "OUTBOX_RELAY__RELAY_ID": relay_id,
                "OUTBOX_RELAY__SHARDS": str(SHARDS),
                "OUTBOX_RELAY__TRANSACTIONAL_ID_PREFIX": "soak-relay",
                "OUTBOX_RELAY__OP_MARKER_TOPIC": MARKER_TOPIC,
                "OUTBOX_RELAY__DEAD_LETTER_TOPIC": DEAD_LETTER_TOPIC,
                "OUTBOX_RELAY__LEASE_DURATION": LEASE,
                "OUTBOX_RELAY__HEARTBEAT_INTERVAL": "PT2S",
                # a killed relay's open Kafka transaction that no successor fences is aborted
                # by the broker after this: the final read_committed read waits at most so long
                "OUTBOX_RELAY__KAFKA_TRANSACTION_TIMEOUT": "PT30S",
                "OUTBOX_RELAY__SHUTDOWN_GRACE": "PT10S",
                "OUTBOX_HTTP__ENABLED": "false",  # several relays on one host: no port clashes
                "OUTBOX_LOG_FORMAT": "json",
            }
        )
        return env
