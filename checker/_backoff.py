"""When to check again after UNKNOWN or a failed check: exponential, capped, jittered."""

from __future__ import annotations

import random
from datetime import timedelta

# 2**1000 overflows nothing in float, but timedelta does; the cap is reached long before.
_MAX_EXPONENT = 64


def backoff(
    check_count: int,
    *,
    interval: timedelta,
    multiplier: float,
    cap: timedelta,
    jitter: float,
    rng: random.Random,
) -> timedelta:
    """``interval * multiplier ** (check_count - 1)``, at most ``cap``, shortened by up to
    ``jitter`` (a fraction in [0, 1)) so that transactions checked together spread out.

    Never longer than the cap, never shorter than ``(1 - jitter)`` times the unjittered wait.
    """
    if check_count < 1:
        raise ValueError("check_count starts at 1")
    if not 0.0 <= jitter < 1.0:
        raise ValueError("jitter is a fraction in [0, 1)")
    exponent = min(check_count - 1, _MAX_EXPONENT)
    seconds = min(interval.total_seconds() * multiplier**exponent, cap.total_seconds())
    if jitter:
        seconds *= 1.0 - jitter * rng.random()
    return timedelta(seconds=seconds)


def spread(delay: timedelta, jitter: float, rng: random.Random) -> timedelta:
    """``delay`` lengthened by up to ``jitter`` of itself (for waits that must not be shorter)."""
    return delay * (1.0 + jitter * rng.random())
