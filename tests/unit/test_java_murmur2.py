"""The tests' copy of the Java client's key hash, against the vectors of Kafka's UtilsTest."""

from __future__ import annotations

import pytest

from tests.fixtures.kafka import java_murmur2


@pytest.mark.parametrize(
    ("key", "signed"),
    [
        (b"21", -973932308),
        (b"foobar", -790332482),
        (b"a-little-bit-long-string", -985981536),
        (b"a-little-bit-longer-string", -1486304829),
        (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
        (b"abc", 479470107),
    ],
)
def test_java_murmur2_matches_kafka(key: bytes, signed: int) -> None:
    assert java_murmur2(key) == signed & 0xFFFFFFFF
