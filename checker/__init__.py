"""The checker: asks producers about stale half (prepared) records, RocketMQ-style check-back.

    from checker import Checker, CheckerSettings

    checker = Checker(settings, dsn)      # settings.endpoints: producer group -> endpoint
    checker.run_once()                    # one round; or start() / stop() for a thread

The checker only changes the database (commit, roll back, discard, reschedule); the relay ships
whatever the changes hand it. Manual tools: ``rearm``, ``resolve``, ``redrive`` and ``drop``
(also as ``outboxctl`` commands of the same names). Errors derive from ``outbox.OutboxError``
(tree in ``checker._errors``).
"""

from checker._breaker import CircuitBreaker, CircuitState
from checker._client import CheckAnswer, CheckClient, HttpCheckClient, Outcome
from checker._errors import CheckerError, TransactionBusyError
from checker._manual import ManualResult, drop, drop_topic, rearm, redrive, redrive_topic, resolve
from checker.config import CheckerSettings, EndpointSettings
from checker.service import Checker, CheckRoundResult

__all__ = [
    "CheckAnswer",
    "CheckClient",
    "CheckRoundResult",
    "Checker",
    "CheckerError",
    "CheckerSettings",
    "CircuitBreaker",
    "CircuitState",
    "EndpointSettings",
    "HttpCheckClient",
    "ManualResult",
    "Outcome",
    "TransactionBusyError",
    "drop",
    "drop_topic",
    "rearm",
    "redrive",
    "redrive_topic",
    "resolve",
]
