"""The op-marker wire format: what the relay writes is what recovery and reconciliation read."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime

import pytest

from relay.markers import (
    MAX_MARKER_KEY_BYTES,
    MAX_MARKER_REASON_CHARS,
    MarkerBatcher,
    MarkerFormatError,
    MarkerTooNew,
    Op,
    OpMarker,
    decode_markers,
    marker_entry,
    marker_messages,
)

COMMIT = datetime(2026, 11, 22, 10, 0, 0, 123456, tzinfo=UTC)


def entry(outbox_id: int, *, reason: str | None = None) -> str:
    return marker_entry(
        Op.DELIVERED if reason is None else Op.PARKED,
        id=outbox_id,
        tx_id=f"tx-{outbox_id}",
        producer_group="orders",
        topic="orders.created",
        key=b"\x00k\xff",
        partition=2,
        offset=outbox_id * 10,
        commit_ts=COMMIT,
        reason=reason,
        xid=outbox_id + 1000,
    )


def test_a_message_decodes_to_its_markers_with_the_envelope() -> None:
    (message,) = marker_messages(
        [entry(1), entry(2, reason="refused: ünïcode")], shard=3, relay="r-1", epoch=7
    )
    first, second = decode_markers(message)
    assert first == OpMarker(
        v=2, op=Op.DELIVERED, id=1, tx_id="tx-1", producer_group="orders",
        topic="orders.created", key=b"\x00k\xff", shard=3, partition=2, offset=10,
        commit_ts=COMMIT, reason=None, xid=1001, relay="r-1", epoch=7,
    )  # fmt: skip
    assert (second.op, second.id, second.reason) == (Op.PARKED, 2, "refused: ünïcode")
    assert message.isascii()  # so that the batcher's count of characters is one of bytes


def test_a_shard_reads_only_its_own_markers_of_a_shared_partition() -> None:
    (message,) = marker_messages([entry(1), entry(2)], shard=3, relay="r-1", epoch=7)
    assert [m.id for m in decode_markers(message, shard=3)] == [1, 2]
    assert decode_markers(message, shard=4) == []
    malformed = message.replace(b'"shard":3', b'"shard":"three"')
    with pytest.raises(MarkerFormatError):  # not taken for another shard's
        decode_markers(malformed, shard=4)
    as_text = message.replace(b'"shard":3', b'"shard":"3"')  # validated into shard 3's
    assert decode_markers(as_text, shard=4) == []
    assert [m.id for m in decode_markers(as_text, shard=3)] == [1, 2]


@pytest.mark.parametrize(
    ("op", "text", "key", "partition", "offset", "commit_ts", "reason", "xid"),
    [
        (Op.DELIVERED, "orders.created", b"\x00k\xff", 2, 10**12, COMMIT, None, 2**40),
        (Op.ROLLED_BACK, 'quote " back\\slash \n tab\t', None, None, None, None, None, None),
        (Op.PARKED, "ünïcode ✓ \u2028 \x01", b"", 0, 0, datetime(2026, 1, 1), 'refused: ✗ "x"', 3),
    ],
)
def test_an_entry_is_exactly_what_json_writes_for_it(
    op: Op,
    text: str,
    key: bytes | None,
    partition: int | None,
    offset: int | None,
    commit_ts: datetime | None,
    reason: str | None,
    xid: int | None,
) -> None:
    fields = {
        "op": op.value, "id": 7, "tx_id": text, "producer_group": text, "topic": text,
        "key": None if key is None else base64.b64encode(key).decode("ascii"),
        "partition": partition, "offset": offset,
        "commit_ts": None if commit_ts is None else commit_ts.isoformat(), "reason": reason,
        "xid": xid,
    }  # fmt: skip
    written = marker_entry(
        op, id=7, tx_id=text, producer_group=text, topic=text, key=key, partition=partition,
        offset=offset, commit_ts=commit_ts, reason=reason, xid=xid,
    )  # fmt: skip
    assert written == json.dumps(fields, separators=(",", ":"))
    assert written.isascii()


def test_an_entry_stays_small_whatever_the_key_and_reason() -> None:
    def written(key: bytes, reason: str) -> OpMarker:
        text = marker_entry(
            Op.PARKED, id=1, tx_id="t", producer_group="g", topic="x", key=key, partition=None,
            offset=None, commit_ts=None, reason=reason,
        )  # fmt: skip
        (marker,) = decode_markers(marker_messages([text], shard=0, relay="r", epoch=1)[0])
        return marker

    at_limit = written(b"k" * MAX_MARKER_KEY_BYTES, "r" * MAX_MARKER_REASON_CHARS)
    assert at_limit.key == b"k" * MAX_MARKER_KEY_BYTES
    assert at_limit.reason == "r" * MAX_MARKER_REASON_CHARS
    over = written(b"k" * (MAX_MARKER_KEY_BYTES + 1), "r" * 1_000_000)
    assert over.key is None
    assert over.reason == "r" * MAX_MARKER_REASON_CHARS


def test_messages_stay_within_the_byte_limit_and_keep_every_entry_in_order() -> None:
    entries = [entry(i) for i in range(100)]
    limit = 4 * len(entries[0])
    messages = marker_messages(entries, shard=0, relay="r", epoch=1, max_bytes=limit)
    head = len(json.dumps({"v": 2, "shard": 0, "relay": "r", "epoch": 1}, separators=(",", ":")))
    assert len(messages) > 20
    assert all(len(m) <= limit + head + len(',"markers":[]') for m in messages)
    assert [m.id for msg in messages for m in decode_markers(msg)] == list(range(100))


def ids(message: bytes | None) -> list[int]:
    assert message is not None
    return [m.id for m in decode_markers(message)]


def test_an_entry_larger_than_the_limit_goes_alone() -> None:
    batcher = MarkerBatcher(shard=0, relay="r", epoch=1, max_bytes=1024)
    assert batcher.add(entry(1)) is None
    # too large: what came before goes first, then it alone
    assert ids(batcher.add(entry(2, reason="x" * 5000))) == [1]
    assert ids(batcher.add(entry(3))) == [2]
    assert ids(batcher.take()) == [3]
    assert batcher.take() is None


def test_version_1_markers_are_still_read() -> None:
    old = OpMarker(
        op=Op.ROLLED_BACK, id=5, tx_id="t", producer_group="g", topic="x", shard=1,
        relay="old", epoch=2,
    )  # fmt: skip
    _key, value = old.encode()
    assert decode_markers(value) == [old]


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (b'{"v": 0, "markers": []}', "unknown version 0"),
        (b"not json", "not an op marker message"),
        (b'{"v": 2, "shard": 0, "relay": "r", "epoch": 1}', "not an op marker message"),
        (b'{"v": 2, "shard": 0, "relay": "r", "epoch": 1, "markers": [{"id": 1}]}', "op"),
        (b"[1, 2]", "unknown version None"),
        # RecursionError escaped: a recovery failed at this message for ever
        (b"[" * 100_000, "not an op marker message"),
        # "!!!" was read as the empty key
        (
            b'{"v": 2, "shard": 0, "relay": "r", "epoch": 1, "markers": [{"op": "delivered", '
            b'"id": 1, "tx_id": "t", "producer_group": "g", "topic": "x", "key": "!!!"}]}',
            "not an op marker message",
        ),
    ],
)
def test_what_is_not_a_marker_message_is_refused_with_the_reason(value: bytes, says: str) -> None:
    with pytest.raises(MarkerFormatError, match=says):
        decode_markers(value)


def test_a_message_of_a_newer_relay_that_may_be_this_shards_is_refused_not_skipped() -> None:
    """Skipped as not a relay's (a rolling upgrade: a newer relay's batch in doubt, recovered
    by an older one), the rows it ended went again: a read_committed consumer saw them twice."""
    newer = b'{"v": 3, "shard": 4, "relay": "r", "epoch": 1, "entries": []}'
    with pytest.raises(MarkerTooNew, match="format version 3, written by a newer relay"):
        decode_markers(newer, shard=4)
    with pytest.raises(MarkerTooNew):
        decode_markers(newer)
    assert decode_markers(newer, shard=3) == []  # another shard's: not this one's business
    with pytest.raises(MarkerTooNew) as named:  # a shard not said may be any
        decode_markers(b'{"v": 3, "relay": "r", "epoch": 1, "outbox": "db/outbox"}', shard=3)
    assert named.value.outbox == "db/outbox"  # another outbox's is told apart by the shard
    # without a relay's envelope, stray JSON: skipped as before, not a shard stopped for good
    with pytest.raises(MarkerFormatError, match="unknown version 5"):
        decode_markers(b'{"v": 5, "shard": 3}', shard=3)
    (message,) = marker_messages([entry(1), entry(2)], shard=4, relay="r", epoch=1)
    new_op = message.replace(b'"op":"delivered"', b'"op":"compacted"', 1)
    with pytest.raises(MarkerTooNew, match="op 'compacted', written by a newer relay"):
        decode_markers(new_op, shard=4)
    assert decode_markers(new_op, shard=3) == []
    old = OpMarker(
        op=Op.ROLLED_BACK, id=5, tx_id="t", producer_group="g", topic="x", shard=1,
        relay="old", epoch=2,
    )  # fmt: skip
    _key, value = old.encode()
    with pytest.raises(MarkerTooNew):
        decode_markers(value.replace(b'"rolled_back"', b'"compacted"'), shard=1)


def test_a_commit_time_of_a_zone_offset_in_seconds_reads_back() -> None:
    """Written as the session's zone gave it (+00:53:28, a historic zone's), pydantic refused
    it, and the recovery skipped the whole message: its batch went again."""
    from datetime import timedelta, timezone

    odd = datetime(2026, 11, 22, 11, 0, 0, tzinfo=timezone(timedelta(minutes=53, seconds=28)))
    text = marker_entry(
        Op.DELIVERED, id=1, tx_id="t", producer_group="g", topic="x", key=None, partition=0,
        offset=0, commit_ts=odd, reason=None,
    )  # fmt: skip
    (marker,) = decode_markers(marker_messages([text], shard=0, relay="r", epoch=1)[0])
    assert marker.commit_ts == odd
