"""Transaction ids the library generates for half records: UUIDv7 (RFC 9562).

Format: the canonical 36-character UUID text, e.g. `0190f3c4-6b1e-7a3b-9c2d-5e8f0a1b2c3d`. The first
48 bits are the Unix time in milliseconds, so ids sort by creation time as text; the remaining 74
bits are random (`secrets`), so ids from many processes do not collide. Python 3.11 has no uuid7.
"""

from __future__ import annotations

import secrets
import time
import uuid


def new_tx_id(now_ns: int | None = None) -> str:
    ms = (time.time_ns() if now_ns is None else now_ns) // 1_000_000
    rand = secrets.randbits(74)
    value = (ms & ((1 << 48) - 1)) << 80  # unix_ts_ms
    value |= 0x7 << 76  # version 7
    value |= (rand >> 62) << 64  # rand_a, 12 bits
    value |= 0b10 << 62  # RFC 9562 variant
    value |= rand & ((1 << 62) - 1)  # rand_b, 62 bits
    return str(uuid.UUID(int=value))
