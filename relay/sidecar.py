"""The sidecar process: relay and checker in one process, probes, metrics, graceful shutdown.

SIGTERM or SIGINT stop it: the relay finishes (or aborts) its Kafka transaction in flight and
hands its shards back, the checker stops claiming, and the process exits within the grace period
(Kubernetes' terminationGracePeriodSeconds should be a little longer than relay.shutdown_grace).
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Protocol

from relay import logs
from relay.config import SidecarSettings
from relay.http import ProbeServer
from relay.service import Relay

logger = logging.getLogger(__name__)

_GAUGE_INTERVAL_S = 10.0


class Component(Protocol):
    def start(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...
    def alive(self) -> bool: ...
    def ready(self) -> dict[str, Any]: ...


def build_components(settings: SidecarSettings, only: str | None = None) -> dict[str, Component]:
    components: dict[str, Component] = {}
    if settings.relay.enabled and only in (None, "relay"):
        components["relay"] = Relay(settings)
    if settings.checker.enabled and only in (None, "checker"):
        from checker.service import Checker

        components["checker"] = Checker.from_sidecar_settings(settings)
    if not components:
        raise SystemExit("outboxctl: nothing to run (relay and checker are both disabled)")
    return components


def run(settings: SidecarSettings, only: str | None = None) -> int:
    """Run until SIGTERM / SIGINT. Returns the process exit code."""
    logs.configure(settings.log_level, settings.log_format)
    components = build_components(settings, only)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logger.info("received %s: shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    probes = None
    if settings.http.enabled:
        probes = ProbeServer(
            settings.http.host,
            settings.http.port,
            alive={name: c.alive for name, c in components.items()},
            ready={name: c.ready for name, c in components.items()},
        )
        probes.start()
    for name, component in components.items():
        component.start()
        logger.info("%s started", name)

    relay = components.get("relay")
    while not stop.wait(_GAUGE_INTERVAL_S if isinstance(relay, Relay) else 3600):
        if isinstance(relay, Relay):
            try:
                relay.refresh_gauges()
            except Exception as exc:  # gauges are best effort; the relay reports its own errors
                logger.warning("could not refresh gauges: %s", exc)

    grace = settings.relay.shutdown_grace.total_seconds()
    for component in components.values():
        component.stop(grace)
    if probes is not None:
        probes.stop()
    logger.info("sidecar stopped")
    return 0
