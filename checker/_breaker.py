"""A circuit breaker per endpoint: stop asking an endpoint that keeps failing, probe it later.

closed     requests go out; ``failure_threshold`` consecutive failures open the circuit;
open       no request goes out until ``cooldown`` has passed since it opened;
half-open  one probe request goes out: success closes the circuit, failure opens it again.

Time comes from an injected clock (the checker's), so tests move it instead of sleeping.
Thread-safe: worker threads report outcomes while the claiming thread reads the state.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta


class CircuitState(enum.IntEnum):
    """Values of the ``outbox_checker_circuit_state`` gauge."""

    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(frozen=True)
class Permit:
    """A request allow() let out: `opening` counts the circuit's openings before it."""

    opening: int


class CircuitBreaker:
    def __init__(
        self,
        *,
        failure_threshold: int,
        cooldown: timedelta,
        clock: Callable[[], datetime],
        on_change: Callable[[CircuitState], None] | None = None,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be at least 1")
        if cooldown <= timedelta(0):
            raise ValueError("cooldown must be positive")
        self._threshold = failure_threshold
        self._cooldown = cooldown
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = CircuitState.CLOSED
        self._failures = 0
        self._opened_at: datetime | None = None
        self._openings = 0
        self._probe_in_flight = False

    def _set(self, state: CircuitState) -> None:
        if state is not self._state:
            self._state = state
            if self._on_change is not None:
                self._on_change(state)

    def _refresh(self) -> CircuitState:
        if (
            self._state is CircuitState.OPEN
            and self._opened_at is not None
            and self._clock() >= self._opened_at + self._cooldown
        ):
            self._set(CircuitState.HALF_OPEN)
            self._probe_in_flight = False
        return self._state

    @property
    def state(self) -> CircuitState:
        with self._lock:
            return self._refresh()

    @property
    def retry_at(self) -> datetime | None:
        """When an open circuit lets a probe through; None unless open."""
        with self._lock:
            if self._refresh() is not CircuitState.OPEN or self._opened_at is None:
                return None
            return self._opened_at + self._cooldown

    def allow(self) -> Permit | None:
        """May a request go out now (a Permit for its outcome), or not (None)? In half-open
        state only one (the probe) is allowed."""
        with self._lock:
            state = self._refresh()
            if state is CircuitState.CLOSED:
                return Permit(self._openings)
            if state is CircuitState.HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return Permit(self._openings)
            return None

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._probe_in_flight = False
            self._opened_at = None
            self._set(CircuitState.CLOSED)

    def record_failure(self, permit: Permit | None = None) -> None:
        """A request failed. One let out before the circuit opened (`permit`; None: since)
        says nothing the failures that opened it did not: counted, a late one pushed an open
        circuit's cooldown back, or reopened a half-open one with its probe still out."""
        with self._lock:
            state = self._refresh()
            if permit is not None and permit.opening != self._openings:
                return
            self._failures += 1
            if state is CircuitState.HALF_OPEN or self._failures >= self._threshold:
                self._opened_at = self._clock()
                self._openings += 1
                self._probe_in_flight = False
                self._set(CircuitState.OPEN)
