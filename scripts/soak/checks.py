"""The soak's verdict: pure functions over what a run left behind, each returning findings.

The inputs are plain data read at the end of a run (database.py, topics.py, writer.py), so the
checks run, and are tested, without services (tests/unit/test_soak_checks.py). What they hold
the relay to is design.md's properties 1 (no loss), 2 (no duplicates for `read_committed`
consumers, one op marker per delivered record), 4 (per-key order is commit order) and 5 (relays
fenced under the chaos: a fenced one's batch is neither lost nor sent twice).
"""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

SAMPLE = 20  # examples kept per finding


@dataclass(frozen=True, slots=True)
class LedgerRow:
    """A record that committed: a row of soak_ledger, written in its own transaction."""

    uid: str
    tx: str
    key: str
    seq: int
    topic: str
    outbox_id: int
    xid: int


@dataclass(frozen=True, slots=True)
class WriterTx:
    """A transaction as its writer saw it end: committed, rolled_back, aborted or unknown."""

    tx: str
    status: str
    uids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Delivered:
    """A message on a soak topic, read with `read_committed`; None where it lacks the field."""

    topic: str
    partition: int
    offset: int
    key: str | None
    outbox_id: int | None  # the relay's outbox-id header
    outbox_tx_id: str | None  # the relay's outbox-tx-id header
    uid: str | None  # the value's own id, given by the writer
    tx: str | None
    seq: int | None

    @property
    def place(self) -> tuple[str, int, int]:
        return (self.topic, self.partition, self.offset)


@dataclass(frozen=True, slots=True)
class Marker:
    """An entry of an op-marker message (relay/markers.py)."""

    op: str
    outbox_id: int
    topic: str
    partition: int | None
    offset: int | None
    outbox: str | None  # "<database>/<schema>" of the rows it ended


@dataclass(frozen=True)
class Observed:
    """Everything the checks judge."""

    ledger: list[LedgerRow]
    writer_txs: list[WriterTx]
    delivered: list[Delivered]
    markers: list[Marker]
    outbox_name: str  # whose markers count: another outbox's on the topic are not ours
    rows_left: dict[str, int]  # outbox_record rows by state after the drain
    dead_letters: list[str]  # the reasons of the copies on the dead-letter topic
    unread: list[str]  # partitions not read to their end: the others' verdict is partial


@dataclass(frozen=True)
class Finding:
    kind: str
    count: int
    sample: list[Any]


def _found(kind: str, items: Iterable[Any]) -> list[Finding]:
    items = list(items)
    return [Finding(kind, len(items), items[:SAMPLE])] if items else []


def missing(o: Observed) -> list[Finding]:
    """Committed (the ledger says so) but not on its topic."""
    delivered = {d.outbox_id for d in o.delivered}
    lost = sorted((r for r in o.ledger if r.outbox_id not in delivered), key=lambda r: r.outbox_id)
    return _found("missing", ({"uid": r.uid, "outbox_id": r.outbox_id} for r in lost))


def duplicates(o: Observed) -> list[Finding]:
    """A record on its topic more than once, by the relay's outbox id or by the value's own id
    (the second catches a record the relay took for two)."""
    by_outbox_id: defaultdict[int | None, list[tuple[str, int, int]]] = defaultdict(list)
    by_uid: defaultdict[str | None, list[tuple[str, int, int]]] = defaultdict(list)
    for d in o.delivered:  # one without the id is found by not_committed
        if d.outbox_id is not None:
            by_outbox_id[d.outbox_id].append(d.place)
        if d.uid is not None:
            by_uid[d.uid].append(d.place)
    return _found(
        "duplicate_outbox_id", ({"id": i, "at": p} for i, p in by_outbox_id.items() if len(p) > 1)
    ) + _found("duplicate_value_id", ({"id": i, "at": p} for i, p in by_uid.items() if len(p) > 1))


def not_committed(o: Observed) -> list[Finding]:
    """Delivered, yet its transaction never committed: rolled back, aborted, or unknown to the
    ledger (a message no soak writer wrote)."""
    committed_ids = {r.outbox_id for r in o.ledger}
    committed_uids = {r.uid for r in o.ledger}
    status = {uid: t.status for t in o.writer_txs for uid in t.uids}
    return _found(
        "delivered_not_committed",
        (
            {"uid": d.uid, "outbox_id": d.outbox_id, "writer_saw": status.get(d.uid or "")}
            for d in o.delivered
            if d.outbox_id not in committed_ids or d.uid not in committed_uids
        ),
    )


def differs_from_ledger(o: Observed) -> list[Finding]:
    """Delivered with another outbox id, key, topic or sequence than its ledger row."""
    rows = {r.uid: r for r in o.ledger}
    return _found(
        "differs_from_ledger",
        (
            {"uid": d.uid, "at": d.place}
            for d in o.delivered
            if (r := rows.get(d.uid or "")) is not None
            and (r.outbox_id, r.key, r.topic, r.seq) != (d.outbox_id, d.key, d.topic, d.seq)
        ),
    )


def writers_against_ledger(o: Observed) -> list[Finding]:
    """The ledger is the truth only if it agrees with what the writers saw end."""
    in_ledger = {r.uid for r in o.ledger}
    said = [(t.status, uid) for t in o.writer_txs for uid in t.uids]
    return _found(
        "committed_not_in_ledger",
        (uid for status, uid in said if status == "committed" and uid not in in_ledger),
    ) + _found(
        "rolled_back_in_ledger",
        (uid for status, uid in said if status in ("rolled_back", "aborted") and uid in in_ledger),
    )


def key_order(o: Observed) -> list[Finding]:
    """Each key on one partition, its sequence strictly increasing in offset order: a key's
    sequence is taken under a row lock held to commit, so it is the key's commit order."""
    by_key: defaultdict[str | None, list[Delivered]] = defaultdict(list)
    for d in o.delivered:
        if d.seq is not None:
            by_key[d.key].append(d)
    spread, disorder = [], []
    for key, copies in by_key.items():
        places = sorted({(d.topic, d.partition) for d in copies})
        if len(places) > 1:
            spread.append({"key": key, "partitions": places})
            continue
        copies.sort(key=lambda d: d.offset)
        disorder += [
            {"key": key, "before": (a.offset, a.seq), "after": (b.offset, b.seq)}
            for a, b in itertools.pairwise(copies)
            if b.seq is not None and a.seq is not None and b.seq <= a.seq
        ]
    return _found("key_on_several_partitions", spread) + _found("key_out_of_order", disorder)


def tx_ids(o: Observed) -> list[Finding]:
    """A writer's transaction is one outbox transaction: one outbox-tx-id on all its records."""
    ids: defaultdict[str, set[str | None]] = defaultdict(set)
    for d in o.delivered:
        if d.tx is not None:
            ids[d.tx].add(d.outbox_tx_id)
    return _found(
        "tx_ids",
        ({"tx": tx, "outbox_tx_ids": sorted(map(str, s))} for tx, s in ids.items() if len(s) != 1),
    )


def markers(o: Observed) -> list[Finding]:
    """Exactly one "delivered" op marker per delivered record, naming where it landed, and no
    marker of another op (nothing in the soak is rolled back by the relay, parked or discarded)."""
    ours = [m for m in o.markers if m.outbox in (None, o.outbox_name)]
    by_id: defaultdict[int, list[Marker]] = defaultdict(list)
    for m in ours:
        if m.op == "delivered":
            by_id[m.outbox_id].append(m)
    places: defaultdict[int | None, set[tuple[str, int, int]]] = defaultdict(set)
    for d in o.delivered:
        places[d.outbox_id].add(d.place)
    absent, several, elsewhere = [], [], []
    for oid, at in places.items():
        found = by_id.get(oid, []) if oid is not None else []
        if not found:
            absent.append(oid)
        elif len(found) > 1:
            several.append({"outbox_id": oid, "markers": len(found)})
        elif (found[0].topic, found[0].partition, found[0].offset) not in at:
            m = found[0]
            elsewhere.append({"outbox_id": oid, "marker": (m.topic, m.partition, m.offset)})
    return (
        _found("marker_missing", absent)
        + _found("marker_several", several)
        + _found("marker_elsewhere", elsewhere)
        + _found("marker_without_record", (oid for oid in by_id if oid not in places))
        + _found("marker_op", ((m.op, m.outbox_id) for m in ours if m.op != "delivered"))
    )


def undrained(o: Observed) -> list[Finding]:
    """Rows still to deliver (or settle) after the drain."""
    left = {s: n for s, n in o.rows_left.items() if s in ("committed", "prepared") and n}
    return _found("undrained", [left] if left else [])


def dead_letters(o: Observed) -> list[Finding]:
    """Copies on the dead-letter topic: the soak writes nothing a relay should park."""
    return _found("dead_letter", o.dead_letters)


def unread(o: Observed) -> list[Finding]:
    return _found("unread_partitions", o.unread)


CHECKS: tuple[Callable[[Observed], list[Finding]], ...] = (
    missing,
    duplicates,
    not_committed,
    differs_from_ledger,
    writers_against_ledger,
    key_order,
    tx_ids,
    markers,
    undrained,
    dead_letters,
    unread,
)


def check(o: Observed) -> list[Finding]:
    """Every finding of every check: none is a clean run."""
    return [finding for c in CHECKS for finding in c(o)]


def xid_inversions(ledger: Iterable[LedgerRow]) -> int:
    """Same-key pairs where the later commit has the smaller xid: how often the run tested that
    the relay orders by commit, not by xid (property 4)."""
    by_key: defaultdict[str, list[LedgerRow]] = defaultdict(list)
    for r in ledger:
        by_key[r.key].append(r)
    return sum(
        b.xid < a.xid
        for rows in by_key.values()
        for a, b in itertools.pairwise(sorted(rows, key=lambda r: r.seq))
    )


def stats(o: Observed) -> dict[str, Any]:
    """What the run amounted to, beside its findings."""
    statuses = Counter(t.status for t in o.writer_txs)
    committed_txs = {r.tx for r in o.ledger}
    return {
        "transactions": dict(statuses),
        "unknown_that_committed": sum(
            t.tx in committed_txs for t in o.writer_txs if t.status == "unknown"
        ),
        "records": len(o.ledger),
        "delivered": len(o.delivered),
        "keys_in_order_check": len({d.key for d in o.delivered if d.seq is not None}),
        "markers": Counter(m.op for m in o.markers if m.outbox in (None, o.outbox_name)),
        "xid_inversions": xid_inversions(o.ledger),
    }
