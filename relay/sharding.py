"""Shards are equal, contiguous ranges of the signed 64-bit key hash space.

Ranges rather than `key_hash % shards`: a range predicate (`key_hash BETWEEN lo AND hi`) is one
the planner can estimate from the column's statistics, so the claim walks the commit-order index
and stops after a batch. An opaque modulo expression is estimated at 0.5% of the rows, which made
the planner scan and sort the whole backlog on every claim.
"""

from __future__ import annotations

_SPACE = 1 << 64
_MIN = -(1 << 63)


def shard_of(key_hash: int, shards: int) -> int:
    """The shard of a record with this key hash."""
    return (key_hash - _MIN) * shards // _SPACE


def shard_range(shard: int, shards: int) -> tuple[int, int]:
    """The key hashes of `shard`, both ends included."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} out of range for {shards} shards")
    lo = _MIN + _ceil_div(shard * _SPACE, shards)
    hi = _MIN + _ceil_div((shard + 1) * _SPACE, shards) - 1
    return lo, hi


def shard_ranges(owned: list[int], shards: int) -> dict[str, list[int]]:
    """Query parameters `lo` and `hi` for a set of shards (relay.sql's `unnest` form)."""
    ranges = [shard_range(s, shards) for s in owned]
    return {"lo": [lo for lo, _ in ranges], "hi": [hi for _, hi in ranges]}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
