"""The sidecar's parts stopped by themselves under on_part_stopped = retry: what the probes and
the gauge say, and when a part is started again (fake parts: the loop's logic only; the real
sidecar is run in tests/integration/test_relay_process.py)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import REGISTRY

from relay import sidecar
from relay.config import SidecarSettings


class _Part:
    def __init__(self) -> None:
        self.ended = False
        self.started = False

    def start(self) -> None:
        self.started = True

    def stop(self, timeout: float | None = None) -> None:
        self.ended = True

    def alive(self) -> bool:
        return not self.ended

    def ended_by_itself(self) -> bool:
        return self.ended

    def running(self) -> bool:
        return self.started and not self.ended

    def ready(self) -> dict[str, Any]:
        return {"ready": True}


def test_a_part_started_again_is_said_stopped_until_it_has_run_a_retry_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Set to 0 at its restart, the gauge of a part that failed again within seconds read 0 at
    most scrapes, and the alert's `for` never ran out."""
    now = [1000.0]
    monkeypatch.setattr(sidecar.time, "monotonic", lambda: now[0])
    built: list[_Part] = []
    monkeypatch.setattr(sidecar, "_build", lambda *_: built.append(_Part()) or built[-1])
    settings = SidecarSettings(
        database={"dsn": "postgresql://db/app"},
        on_part_stopped="retry",
        part_retry_interval="PT60S",
    )
    first = _Part()
    parts = sidecar._Parts(settings, {"relay": first})

    def gauge() -> float | None:
        return REGISTRY.get_sample_value("outbox_sidecar_part_stopped", {"part": "relay"})

    assert gauge() == 0
    first.ended = True  # stopped by a setting that cannot work
    parts.wait_to_retry(parts.newly_stopped())
    assert gauge() == 1
    assert parts.alive("relay")()  # the liveness probe would not mend it
    assert parts.ready("relay")() == {"ready": False, "stopped": True}
    assert parts.newly_stopped() == []  # said once
    now[0] += 59
    parts.retry_due()
    assert built == []  # not yet
    now[0] += 1
    parts.retry_due()
    (second,) = built
    assert second.started
    assert parts.components["relay"] is second
    assert gauge() == 1  # on trial
    second.ended = True  # fails again at once
    parts.wait_to_retry(parts.newly_stopped())
    now[0] += 30
    parts.retry_due()
    assert gauge() == 1  # never 0 between the two
    now[0] += 30
    parts.retry_due()
    third = built[-1]
    assert third is not second
    assert third.started
    now[0] += 60  # runs a whole interval
    parts.retry_due()
    assert gauge() == 0
    assert parts.ready("relay")() == {"ready": True}
