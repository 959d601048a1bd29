"""The per-endpoint circuit breaker, on a clock the test moves (pure logic)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from checker._breaker import CircuitBreaker, CircuitState

T0 = datetime(2024, 5, 1, tzinfo=UTC)
COOLDOWN = timedelta(seconds=30)


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def changes() -> list[CircuitState]:
    return []


@pytest.fixture
def breaker(clock: Clock, changes: list[CircuitState]) -> CircuitBreaker:
    return CircuitBreaker(
        failure_threshold=3, cooldown=COOLDOWN, clock=clock, on_change=changes.append
    )


def test_closed_until_threshold_consecutive_failures(breaker: CircuitBreaker) -> None:
    breaker.record_failure()
    breaker.record_failure()
    assert breaker.state is CircuitState.CLOSED
    assert breaker.allow()
    breaker.record_failure()
    assert breaker.state is CircuitState.OPEN
    assert not breaker.allow()
    assert breaker.retry_at == T0 + COOLDOWN


def test_a_success_resets_the_count(breaker: CircuitBreaker) -> None:
    for _ in range(2):
        breaker.record_failure()
    breaker.record_success()
    for _ in range(2):
        breaker.record_failure()
    assert breaker.state is CircuitState.CLOSED


def test_half_open_after_cooldown_lets_one_probe_through(
    breaker: CircuitBreaker, clock: Clock
) -> None:
    for _ in range(3):
        breaker.record_failure()
    clock.now += COOLDOWN - timedelta(milliseconds=1)
    assert breaker.state is CircuitState.OPEN
    assert not breaker.allow()
    clock.now += timedelta(milliseconds=1)
    assert breaker.state is CircuitState.HALF_OPEN
    assert breaker.retry_at is None
    assert breaker.allow()  # the probe
    assert not breaker.allow()  # only one at a time


def test_probe_success_closes(
    breaker: CircuitBreaker, clock: Clock, changes: list[CircuitState]
) -> None:
    for _ in range(3):
        breaker.record_failure()
    clock.now += COOLDOWN
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is CircuitState.CLOSED
    assert breaker.allow()
    assert breaker.allow()
    assert changes == [CircuitState.OPEN, CircuitState.HALF_OPEN, CircuitState.CLOSED]


def test_probe_failure_opens_again_for_a_full_cooldown(
    breaker: CircuitBreaker, clock: Clock
) -> None:
    for _ in range(3):
        breaker.record_failure()
    clock.now += COOLDOWN + timedelta(seconds=5)
    assert breaker.allow()
    breaker.record_failure()  # one failure is enough in half-open state
    assert breaker.state is CircuitState.OPEN
    assert breaker.retry_at == clock.now + COOLDOWN


def test_rejects_nonsense(clock: Clock) -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0, cooldown=COOLDOWN, clock=clock)
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=1, cooldown=timedelta(0), clock=clock)


def test_a_late_failure_of_a_request_sent_before_the_circuit_opened_changes_nothing(
    breaker: CircuitBreaker, clock: Clock
) -> None:
    """A request out while the circuit was closed, failing after it opened, pushed the open
    circuit's cooldown back; failing while it was half-open, it reopened it with the probe
    still out (found by a review of the checker)."""
    late = [breaker.allow() for _ in range(3)]  # out together, under the closed circuit
    for _ in range(3):
        breaker.record_failure()  # others' failures open it
    assert breaker.state is CircuitState.OPEN
    clock.now += timedelta(seconds=4)
    breaker.record_failure(late[0])
    assert breaker.retry_at == T0 + COOLDOWN  # not pushed back to T0 + 4 s + COOLDOWN
    clock.now = T0 + COOLDOWN + timedelta(seconds=1)
    probe = breaker.allow()
    assert probe is not None
    breaker.record_failure(late[1])  # with the probe still out
    assert breaker.state is CircuitState.HALF_OPEN
    breaker.record_success()  # the probe's answer decides
    assert breaker.state is CircuitState.CLOSED


def test_the_probes_failure_opens_the_circuit_again(breaker: CircuitBreaker, clock: Clock) -> None:
    for _ in range(3):
        breaker.record_failure()
    clock.now += COOLDOWN
    probe = breaker.allow()
    assert probe is not None
    breaker.record_failure(probe)
    assert breaker.state is CircuitState.OPEN
    assert breaker.retry_at == clock.now + COOLDOWN
