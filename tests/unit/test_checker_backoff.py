"""Backoff after UNKNOWN or a failed check: exponential, capped, jittered (pure logic)."""

from __future__ import annotations

import random
from datetime import timedelta

import pytest

from checker._backoff import backoff, spread

S = timedelta(seconds=1)


def wait(count: int, *, jitter: float = 0.0, rng: random.Random | None = None) -> timedelta:
    return backoff(
        count,
        interval=30 * S,
        multiplier=2.0,
        cap=600 * S,
        jitter=jitter,
        rng=rng or random.Random(1),
    )


def test_grows_by_the_multiplier_from_the_interval() -> None:
    assert [wait(n) for n in (1, 2, 3, 4, 5)] == [30 * S, 60 * S, 120 * S, 240 * S, 480 * S]


def test_is_capped_at_max_backoff_even_for_huge_counts() -> None:
    assert wait(6) == 600 * S
    assert wait(10_000) == 600 * S


def test_multiplier_one_is_a_fixed_interval() -> None:
    rng = random.Random(0)
    got = {backoff(n, interval=S, multiplier=1.0, cap=60 * S, jitter=0, rng=rng) for n in (1, 9)}
    assert got == {S}


def test_jitter_only_shortens_and_stays_within_its_fraction() -> None:
    rng = random.Random(42)
    samples = [wait(3, jitter=0.25, rng=rng) for _ in range(500)]
    assert all(90 * S <= s <= 120 * S for s in samples)
    assert len(set(samples)) > 400  # really spread out
    capped = [wait(20, jitter=0.25, rng=rng) for _ in range(100)]
    assert max(capped) <= 600 * S


def test_same_seed_same_waits() -> None:
    a = [wait(n, jitter=0.5, rng=random.Random(7)) for n in range(1, 6)]
    b = [wait(n, jitter=0.5, rng=random.Random(7)) for n in range(1, 6)]
    assert a == b


@pytest.mark.parametrize(("count", "jitter"), [(0, 0.0), (1, 1.0), (1, -0.1)])
def test_rejects_nonsense(count: int, jitter: float) -> None:
    with pytest.raises(ValueError):
        wait(count, jitter=jitter)


def test_spread_only_lengthens() -> None:
    rng = random.Random(3)
    samples = [spread(100 * S, 0.1, rng) for _ in range(200)]
    assert all(100 * S <= s <= 110 * S for s in samples)
    assert spread(100 * S, 0.0, rng) == 100 * S
