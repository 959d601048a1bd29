"""The soak's checks (scripts/soak/checks.py) on small hand-made runs: a clean one passes, and
each kind of harm done to it is found, alone."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from scripts.soak.checks import (
    Delivered,
    LedgerRow,
    Marker,
    Observed,
    WriterTx,
    check,
    xid_inversions,
)

OUTBOX = "soak/outbox"
PARTITION = {"k00": ("soak.a", 1), "k01": ("soak.b", 0)}

# Three committed transactions, the second over two keys, and one rolled back:
#   t1: k00#1            t2: k00#2, k01#1            t3: k00#3            t4: k01#2, rolled back
LEDGER = [
    LedgerRow("t1.0", "t1", "k00", 1, "soak.a", outbox_id=1, xid=101),
    LedgerRow("t2.0", "t2", "k00", 2, "soak.a", outbox_id=2, xid=100),  # waited on t1's lock
    LedgerRow("t2.1", "t2", "k01", 1, "soak.b", outbox_id=3, xid=100),
    LedgerRow("t3.0", "t3", "k00", 3, "soak.a", outbox_id=4, xid=102),
]
ROLLED_BACK = LedgerRow("t4.0", "t4", "k01", 2, "soak.b", outbox_id=5, xid=103)  # not in LEDGER
WRITERS = [
    WriterTx("t1", "committed", ("t1.0",)),
    WriterTx("t2", "committed", ("t2.0", "t2.1")),
    WriterTx("t3", "committed", ("t3.0",)),
    WriterTx("t4", "rolled_back", ("t4.0",)),
]


def deliver(rows: list[LedgerRow]) -> list[Delivered]:
    """The rows as the relay put them on their topics: in this order, at the next offsets."""
    offsets: Counter[tuple[str, int]] = Counter()
    delivered = []
    for r in rows:
        topic, partition = PARTITION[r.key]
        offset = offsets[(topic, partition)]
        offsets[(topic, partition)] += 1
        delivered.append(
            Delivered(
                topic, partition, offset, r.key, r.outbox_id, f"xid:{r.xid}", r.uid, r.tx, r.seq
            )
        )
    return delivered


def mark(delivered: list[Delivered]) -> list[Marker]:
    """A "delivered" op marker per copy, where it landed."""
    return [
        Marker("delivered", d.outbox_id or 0, d.topic, d.partition, d.offset, OUTBOX)
        for d in delivered
    ]


def run(delivered: list[Delivered], markers: list[Marker] | None = None) -> Observed:
    return Observed(
        ledger=LEDGER,
        writer_txs=WRITERS,
        delivered=delivered,
        markers=mark(delivered) if markers is None else markers,
        outbox_name=OUTBOX,
        rows_left={},
        dead_letters=[],
        unread=[],
    )


def kinds(observed: Observed) -> set[str]:
    return {f.kind for f in check(observed)}


def test_a_clean_run_has_no_violation() -> None:
    assert check(run(deliver(LEDGER))) == []


def test_a_lost_record_is_found() -> None:
    lost = deliver([r for r in LEDGER if r.uid != "t2.1"])
    (finding,) = check(run(lost))
    assert (finding.kind, finding.sample) == ("missing", [{"uid": "t2.1", "outbox_id": 3}])


def test_a_duplicate_is_found_by_both_ids() -> None:
    delivered = deliver([*LEDGER, LEDGER[0]])  # t1.0 again, after t3.0
    assert kinds(run(delivered)) == {
        "duplicate_outbox_id",
        "duplicate_value_id",
        "key_out_of_order",  # k00's sequence goes 1, 2, 3, 1
        "marker_several",
    }
    assert kinds(run(delivered, markers=mark(delivered[:-1]))) == {
        "duplicate_outbox_id",
        "duplicate_value_id",
        "key_out_of_order",
    }  # the relay's recovery sent it again, without a marker: found all the same


def test_a_reordered_pair_of_a_key_is_found() -> None:
    (finding,) = check(run(deliver([LEDGER[1], LEDGER[0], LEDGER[2], LEDGER[3]])))
    assert finding.kind == "key_out_of_order"
    assert finding.sample == [{"key": "k00", "before": (0, 2), "after": (1, 1)}]


def test_a_rolled_back_record_delivered_is_found() -> None:
    (finding,) = check(run(deliver([*LEDGER, ROLLED_BACK])))
    assert finding.kind == "delivered_not_committed"
    assert finding.sample == [{"uid": "t4.0", "outbox_id": 5, "writer_saw": "rolled_back"}]


def test_a_missing_marker_is_found() -> None:
    delivered = deliver(LEDGER)
    (finding,) = check(run(delivered, markers=mark(delivered)[1:]))
    assert (finding.kind, finding.sample) == ("marker_missing", [1])


CLEAN = run(deliver(LEDGER))
ELSEWHERE = [dataclasses.replace(d, partition=2) if d.uid == "t3.0" else d for d in CLEAN.delivered]
# Each harm as the fields of the clean run it replaces, under the one kind that finds it.
HARMS: dict[str, dict[str, Any]] = {
    "marker_elsewhere": {
        "markers": [dataclasses.replace(CLEAN.markers[0], offset=7), *CLEAN.markers[1:]]
    },
    "marker_without_record": {
        "markers": [*CLEAN.markers, Marker("delivered", 99, "soak.a", 1, 9, OUTBOX)]
    },
    "marker_op": {
        "markers": [*CLEAN.markers, Marker("parked", 4, "soak.dead-letter", 0, 0, OUTBOX)]
    },
    "tx_ids": {
        "delivered": [
            dataclasses.replace(d, outbox_tx_id="xid:7") if d.uid == "t2.1" else d
            for d in CLEAN.delivered
        ]
    },
    "key_on_several_partitions": {"delivered": ELSEWHERE, "markers": mark(ELSEWHERE)},
    "committed_not_in_ledger": {"writer_txs": [*WRITERS, WriterTx("t5", "committed", ("t5.0",))]},
    "undrained": {"rows_left": {"committed": 2, "prepared": 0}},
    "dead_letter": {"dead_letters": ["record too large"]},
    "unread_partitions": {"unread": ["soak.a:1"]},
}


@pytest.mark.parametrize("kind", HARMS)
def test_each_other_harm_is_found_alone(kind: str) -> None:
    assert kinds(dataclasses.replace(CLEAN, **HARMS[kind])) == {kind}


def test_another_outboxs_markers_on_the_topic_are_not_ours() -> None:
    delivered = deliver(LEDGER)
    foreign = [dataclasses.replace(m, outbox="other/outbox") for m in mark(delivered)]
    assert check(run(delivered, markers=mark(delivered) + foreign)) == []


def test_xid_inversions_count_later_commits_with_smaller_xids() -> None:
    assert xid_inversions(LEDGER) == 1  # t2 committed after t1 with the smaller xid
