"""Shard leases in Postgres: which relay delivers which shard, with heartbeats and expiry.

Each relay heartbeats its membership and takes its share of the shards (`share`): free ones,
or ones whose lease expired. Taking a shard bumps its epoch; every write a relay makes for a
shard is conditioned on (owner, epoch), and its Kafka producer uses a transactional.id per
shard, so a stale owner (paused, partitioned) is fenced by Postgres and by Kafka alike.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import psycopg

from outbox import sql as queries
from relay import metrics

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lease:
    shard: int
    epoch: int
    marker_partition: int | None
    marker_offset: int


def share(shards: int, members: list[str], relay_id: str) -> int:
    """How many shards `relay_id` holds among the live `members`: shards // members each, and
    one more for the first shards % members of them by id, so that the shares add up to the
    shards. ceil(shards / members) each left relays with none (4 shards, 3 relays: 2, 2, 0)."""
    ranked = sorted(set(members) | {relay_id})
    base, extra = divmod(shards, len(ranked))
    return base + (1 if ranked.index(relay_id) < extra else 0)


class ShardCountMismatch(Exception):
    """The outbox's lease rows were made for another shard count than this relay's."""

    def __init__(self, running: int, configured: int) -> None:
        super().__init__(f"leases made for {running} shards, this relay has {configured}")
        self.running, self.configured = running, configured


@dataclass
class LeaseChanges:
    gained: list[Lease] = field(default_factory=list)
    lost: list[int] = field(default_factory=list)  # taken over by another relay: stop at once
    to_release: list[int] = field(default_factory=list)  # over our fair share: hand back


class LeaseManager:
    def __init__(self, schema: str, relay_id: str, shards: int, duration: timedelta) -> None:
        self.schema = schema
        self.relay_id = relay_id
        self.shards = shards
        self.duration = duration
        self.owned: dict[int, Lease] = {}

    def _q(self, name: str) -> bytes:
        return queries.query(name, self.schema)

    def heartbeat(self, conn: psycopg.Connection[Any], *, take: bool = True) -> LeaseChanges:
        """Renew our leases, learn which we lost, take our fair share (unless not `take`: a
        relay that stops would only bump their epochs and hand them back). Two short
        transactions."""
        changes = LeaseChanges()
        # A transaction of its own: the lock is held for a moment only, not while the renewal
        # below waits for a lease row (one relay's batch end holds its row), which made every
        # other relay's heartbeat wait behind it.
        with conn.transaction():
            conn.execute(self._q("relay_lock_shard_set"), {"schema": self.schema})
            row = conn.execute(self._q("relay_shard_count")).fetchone()
            if row and row[0] and row[0] != self.shards:
                raise ShardCountMismatch(row[0], self.shards)
            conn.execute(self._q("relay_ensure_shards"), {"shards": self.shards})
        # Kept once the transaction commits: a commit that fails leaves what was held before,
        # not leases gained that no worker would ever deliver (renewed for ever, probes green).
        owned = dict(self.owned)
        with conn.transaction():
            changes.lost = self._renew(conn, owned)
            for shard in changes.lost:
                del owned[shard]
            members = [row[0] for row in conn.execute(self._q("relay_members_alive"))]
            fair = share(self.shards, members, self.relay_id)
            if take and len(owned) < fair:
                for shard, epoch, partition, offset in conn.execute(
                    self._q("relay_acquire"),
                    {
                        "owner": self.relay_id,
                        "duration": self.duration,
                        "shards": self.shards,
                        "want": fair - len(owned),
                    },
                ):
                    lease = Lease(shard, epoch, partition, offset)
                    owned[shard] = lease
                    changes.gained.append(lease)
            elif len(owned) > fair:
                changes.to_release = sorted(owned)[fair:]
        self.owned = owned
        metrics.LEASE_CHANGES.labels("taken").inc(len(changes.gained))
        metrics.LEASE_CHANGES.labels("lost").inc(len(changes.lost))
        for lease in changes.gained:
            logger.info("took shard %s (epoch %s)", lease.shard, lease.epoch)
        for shard in changes.lost:
            logger.warning("lost shard %s: another relay took its lease over", shard)
        return changes

    def renew(self, conn: psycopg.Connection[Any]) -> list[int]:
        """Renew our membership and leases only: no shard taken or handed back (a shard waiting
        on Kafka cannot hand back the shard it ships). Returns the shards not renewed; what
        we hold does not change: the next heartbeat finds them lost again and acts on it."""
        owned = dict(self.owned)
        with conn.transaction():
            return self._renew(conn, owned)

    def _renew(self, conn: psycopg.Connection[Any], owned: dict[int, Lease]) -> list[int]:
        """In the caller's transaction: renew our membership and these leases (owner and epoch
        ours still); the shards that were not renewed, sorted."""
        conn.execute(self._q("relay_lease_no_timeouts"))
        conn.execute(
            self._q("relay_member_heartbeat"), {"relay_id": self.relay_id, "ttl": self.duration}
        )
        if not owned:
            return []
        renewed = {
            row[0]
            for row in conn.execute(
                self._q("relay_renew"),
                {
                    "owner": self.relay_id,
                    "duration": self.duration,
                    "shards": list(owned),
                    "epochs": [lease.epoch for lease in owned.values()],
                },
            )
        }
        return sorted(set(owned) - renewed)

    def release(self, conn: psycopg.Connection[Any], shard: int) -> None:
        lease = self.owned.pop(shard, None)
        if lease is None:
            return
        with conn.transaction():
            handed = conn.execute(
                self._q("relay_release"),
                {"shard": shard, "owner": self.relay_id, "epoch": lease.epoch},
            ).rowcount
        if not handed:  # taken over since the last renewal: a stop after a stall, say
            metrics.LEASE_CHANGES.labels("lost").inc()
            logger.warning("shard %s was taken over before this relay handed it back", shard)
            return
        metrics.LEASE_CHANGES.labels("handed_back").inc()
        logger.info("released shard %s", shard)

    def forget(self, shard: int) -> None:
        """Drop a shard whose lease we found lost (a fenced batch: the heartbeat's losses are
        gone from `owned` already), without touching its lease row."""
        if self.owned.pop(shard, None) is not None:
            metrics.LEASE_CHANGES.labels("lost").inc()

    def leave(self, conn: psycopg.Connection[Any]) -> None:
        for shard in list(self.owned):
            self.release(conn, shard)
        with conn.transaction():
            conn.execute(self._q("relay_member_leave"), {"relay_id": self.relay_id})
