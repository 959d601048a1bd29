"""The sidecar process: relay and checker in one process, probes, metrics, graceful shutdown.

SIGTERM or SIGINT stop it: the relay finishes (or aborts) its Kafka transaction in flight and
hands its shards back, the checker stops claiming, and the process exits within the grace period
(Kubernetes' terminationGracePeriodSeconds should be a little longer than relay.shutdown_grace);
a part still running after it makes the exit status 1.
A part whose thread ended by itself (a relay stopped by a setting that cannot work) makes the
process exit with status 1, so that it is restarted with the error in its log; a slow or stuck
one is left to the liveness probe.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol

from relay import logs
from relay.config import SidecarSettings
from relay.http import ProbeServer
from relay.kafka import check_client_settings
from relay.service import Relay
from relay.signals import StopOnSignals

logger = logging.getLogger(__name__)

_GAUGE_INTERVAL_S = 10.0
_WATCH_INTERVAL_S = 1.0  # how soon a part that ended by itself ends the process
# What a stop takes beyond a database wait it is caught in (each shard's hand-over, the last
# ends): a SIGTERM in a database outage exits within about connect_timeout_s plus this
# (tests/integration/test_relay_failover.py)
STOP_BEYOND_A_DATABASE_WAIT_S = 2.0


class Component(Protocol):
    def start(self) -> None: ...
    def stop(self, timeout: float | None = None) -> None: ...
    def alive(self) -> bool: ...
    def ended_by_itself(self) -> bool: ...
    def running(self) -> bool: ...
    def ready(self) -> dict[str, Any]: ...


def check_settings(settings: SidecarSettings) -> None:
    """What only the Kafka client can tell of the settings (ProducerMisconfigured): before
    anything starts, and by `outboxctl config`."""
    if settings.relay.enabled:
        check_client_settings(
            settings.kafka.to_librdkafka(), settings.relay.kafka_transaction_timeout
        )
        _warn_if_a_database_wait_outlasts_the_grace(settings)


def _warn_if_a_database_wait_outlasts_the_grace(settings: SidecarSettings) -> None:
    """Said, not refused: it matters only in a database outage, and costs a slower hand-over
    then (the shards move when their leases expire), not a record."""
    wait = settings.database.connect_timeout_s
    grace = settings.relay.shutdown_grace.total_seconds()
    if wait + STOP_BEYOND_A_DATABASE_WAIT_S > grace:
        logger.warning(
            "database.connect_timeout_s (%gs) is not %gs below relay.shutdown_grace (%gs): a "
            "SIGTERM during a database outage waits up to connect_timeout_s for the database, "
            "overruns the grace and exits 1 without handing its shards back (they move when "
            "their leases expire); lower database.connect_timeout_s or raise "
            "relay.shutdown_grace",
            wait,
            STOP_BEYOND_A_DATABASE_WAIT_S,
            grace,
        )


def build_components(settings: SidecarSettings, only: str | None = None) -> dict[str, Component]:
    components: dict[str, Component] = {}
    if settings.relay.enabled and only in (None, "relay"):
        check_settings(settings)
        components["relay"] = Relay(settings)
    if settings.checker.enabled and only in (None, "checker"):
        from checker.service import Checker

        components["checker"] = Checker.from_sidecar_settings(settings)
    if not components:
        # logged, not a SystemExit's message: a raw line in the sidecar's JSON logs
        logger.critical(
            "nothing to run: %s",
            f"the {only} is disabled ({only}.enabled = false)"
            if only is not None
            else "the relay and the checker are both disabled",
        )
        raise SystemExit(1)
    return components


def run(settings: SidecarSettings, only: str | None = None) -> int:
    """Run until SIGTERM / SIGINT. Returns the process exit code."""
    logs.configure(settings.log_level, settings.log_format)
    components = build_components(settings, only)
    stop = threading.Event()
    StopOnSignals(stop, "shutting down").install()

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
    if isinstance(relay, Relay):
        # On a thread of its own: a refresh waits for a new connection and three queries (up to
        # the connect timeout in an outage), and in the main loop a SIGTERM waited for it.
        threading.Thread(
            target=_refresh_gauges, args=(relay, stop), name="outbox-gauges", daemon=True
        ).start()
    status = 0
    while not stop.wait(_WATCH_INTERVAL_S):
        dead = [name for name, c in components.items() if c.ended_by_itself()]
        if dead:  # e.g. a relay that stopped on a setting that cannot work: exit, be restarted
            logger.critical("%s no longer running: the sidecar exits", ", ".join(dead))
            status = 1
            break

    # All at once, within one grace period: one after the other, each with the whole grace,
    # ran past the pod's terminationGracePeriodSeconds.
    grace = settings.relay.shutdown_grace.total_seconds()
    deadline = time.monotonic() + grace
    stoppers = [
        threading.Thread(target=c.stop, args=(grace,), name=f"stop-{name}", daemon=True)
        for name, c in components.items()
    ]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        stopper.join(max(0.0, deadline - time.monotonic()) + 1.0)
    if probes is not None:
        probes.stop()
    stuck = [name for name, c in components.items() if c.running()]
    if stuck:
        # Not a clean stop: a Kafka transaction may be open (the broker aborts it after
        # relay.kafka_transaction_timeout) and leases held until they expire. Said by the exit
        # status too, not only in a log line.
        logger.error("%s did not stop within the grace period", ", ".join(stuck))
        return 1
    logger.info("sidecar stopped")
    return status


def _refresh_gauges(relay: Relay, stop: threading.Event) -> None:
    while not stop.wait(_GAUGE_INTERVAL_S):
        try:
            relay.refresh_gauges()
        except Exception as exc:  # gauges are best effort; the relay reports its own errors
            logger.warning("could not refresh gauges: %s", exc)
