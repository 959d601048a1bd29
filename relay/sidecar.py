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

import ipaddress
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from relay import logs, metrics
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


def check_settings(settings: SidecarSettings, only: str | None = None) -> None:
    """What only the Kafka client can tell of the settings (ProducerMisconfigured), and what is
    said but not refused: before anything starts, and by `outboxctl config`."""
    if settings.relay.enabled and only in (None, "relay"):
        check_client_settings(
            settings.kafka.to_librdkafka(), settings.relay.kafka_transaction_timeout
        )
        _warn_if_a_database_wait_outlasts_the_grace(settings)
    if settings.checker.enabled and only in (None, "checker"):
        _warn_of_plain_http_beyond_the_pod(settings)


def _warn_of_plain_http_beyond_the_pod(settings: SidecarSettings) -> None:
    """Said, not refused: the signatures keep a check's answer from being forged or replayed
    over plain http, but not its request from being read, and the usual endpoint is the
    application beside the sidecar, on the loopback interface, where http is fine."""
    for group, endpoint in settings.checker.endpoints.items():
        if endpoint.url.scheme == "http" and not _loopback(endpoint.url.host or ""):
            logger.warning(
                "checker.endpoints.%s.url (%s) is plain http to another host: each check's "
                "records (ids, topics, keys, headers) cross the network readable by anyone on "
                "the path; use https (with ca_file for a private CA)",
                group,
                endpoint.shown_url,
            )


def _loopback(host: str) -> bool:
    """A host on this pod's own loopback interface. Not `*.localhost`: only `localhost` is in
    a container's /etc/hosts, and the others go to the cluster's DNS with its search domains."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost":
        return True
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    # ::ffff:127.0.0.1 is not is_loopback before Python 3.13
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


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
    check_settings(settings, only)
    if settings.relay.enabled and only in (None, "relay"):
        components["relay"] = _build("relay", settings)
    if settings.checker.enabled and only in (None, "checker"):
        components["checker"] = _build("checker", settings)
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


def _build(part: str, settings: SidecarSettings) -> Component:
    if part == "relay":
        return Relay(settings)
    from checker.service import Checker

    return Checker.from_sidecar_settings(settings)


class _Parts:
    """The running parts, and those stopped by themselves that wait to be started again
    (on_part_stopped = retry): a stopped part is alive for the liveness probe (restarting the
    process would not mend it, and in an application's pod it made the pod unready) and not
    ready, whatever it reported before it stopped."""

    def __init__(self, settings: SidecarSettings, components: dict[str, Component]) -> None:
        self.settings = settings
        self.components = components
        self.stopped_at: dict[str, float] = {}
        # started again, on trial: still said stopped until it has run a retry interval (set to
        # 0 at the restart, a part failing again within seconds read 0 at most scrapes, and
        # the alert's `for` never ran out)
        self.restarted_at: dict[str, float] = {}
        for name in components:
            metrics.PART_STOPPED.labels(name).set(0)

    def alive(self, name: str) -> Callable[[], bool]:
        return lambda: name in self.stopped_at or self.components[name].alive()

    def ready(self, name: str) -> Callable[[], dict[str, Any]]:
        def report() -> dict[str, Any]:
            if name in self.stopped_at:
                return {"ready": False, "stopped": True}
            return self.components[name].ready()

        return report

    def newly_stopped(self) -> list[str]:
        return [
            name
            for name, c in self.components.items()
            if name not in self.stopped_at and c.ended_by_itself()
        ]

    def wait_to_retry(self, names: list[str]) -> None:
        interval = self.settings.part_retry_interval.total_seconds()
        for name in names:
            self.stopped_at[name] = time.monotonic()
            metrics.PART_STOPPED.labels(name).set(1)
            logger.critical(
                "%s stopped (why is logged above): started again in %gs (on_part_stopped = "
                "retry); the sidecar stays up",
                name,
                interval,
            )

    def retry_due(self) -> None:
        interval = self.settings.part_retry_interval.total_seconds()
        for name, at in list(self.restarted_at.items()):
            if name in self.stopped_at:  # failed again on trial: its gauge stayed 1
                del self.restarted_at[name]
            elif time.monotonic() - at >= interval:
                del self.restarted_at[name]
                metrics.PART_STOPPED.labels(name).set(0)
                logger.info("%s has run %gs since it was started again", name, interval)
        for name, at in list(self.stopped_at.items()):
            if time.monotonic() - at < interval:
                continue
            try:
                component = _build(name, self.settings)
                component.start()
            except Exception as exc:  # tried again after another interval
                self.stopped_at[name] = time.monotonic()
                logger.critical("%s could not be started again: %s", name, exc, exc_info=True)
                continue
            self.components[name] = component
            del self.stopped_at[name]
            self.restarted_at[name] = time.monotonic()
            logger.info("%s started again", name)


def run(settings: SidecarSettings, only: str | None = None) -> int:
    """Run until SIGTERM / SIGINT. Returns the process exit code."""
    logs.configure(settings.log_level, settings.log_format)
    parts = _Parts(settings, build_components(settings, only))
    components = parts.components  # the current ones: a part started again replaces its own
    stop = threading.Event()
    StopOnSignals(stop, "shutting down").install()

    probes = None
    if settings.http.enabled:
        probes = ProbeServer(
            settings.http.host,
            settings.http.port,
            alive={name: parts.alive(name) for name in components},
            ready={name: parts.ready(name) for name in components},
        )
        probes.start()
    for name, component in components.items():
        component.start()
        logger.info("%s started", name)

    if "relay" in components:
        # On a thread of its own: a refresh waits for a new connection and three queries (up to
        # the connect timeout in an outage), and in the main loop a SIGTERM waited for it.
        threading.Thread(
            target=_refresh_gauges,
            args=(lambda: components.get("relay"), stop),
            name="outbox-gauges",
            daemon=True,
        ).start()
    status = 0
    while not stop.wait(_WATCH_INTERVAL_S):
        dead = parts.newly_stopped()
        if dead and settings.on_part_stopped == "exit":
            # e.g. a relay that stopped on a setting that cannot work: exit, be restarted
            logger.critical("%s no longer running: the sidecar exits", ", ".join(dead))
            status = 1
            break
        parts.wait_to_retry(dead)
        parts.retry_due()

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


def _refresh_gauges(relay: Callable[[], Component | None], stop: threading.Event) -> None:
    while not stop.wait(_GAUGE_INTERVAL_S):
        current = relay()  # a relay started again is another object
        if not isinstance(current, Relay) or not current.running():
            continue
        try:
            current.refresh_gauges()
        except Exception as exc:  # gauges are best effort; the relay reports its own errors
            logger.warning("could not refresh gauges: %s", exc)
