"""The test session's sweep of the topics its tests left on the broker (tests/fixtures/kafka.py)."""

from tests.fixtures.kafka import made_and_left


def test_only_test_topics_made_during_the_session_are_swept() -> None:
    before = {"t.old.1", "markers.old", "demo.orders", "__consumer_offsets"}
    after = before | {"t.new.2", "markers.ab12", "dlt.ab12", "orders", "bench.relay.x", "tx.y"}
    assert made_and_left(before, after) == ["dlt.ab12", "markers.ab12", "t.new.2"]


def test_a_topic_deleted_during_the_session_is_not_swept_again() -> None:
    assert made_and_left({"t.a"}, set()) == []
