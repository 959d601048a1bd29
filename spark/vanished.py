"""Topic partitions that left the streaming source: deleted topics (or ones ACLs now hide).

The source runs with failOnDataLoss=false: with Spark's default, one watched topic deleted
failed the query, and every restart from its checkpoint failed again (its offsets name the
partition), so the reconciliation of every topic stopped until the checkpoint was thrown away.
Going on instead, the job says once which partitions went, from the source's progress.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)


def _partitions(offsets: str | None) -> set[tuple[str, int]]:
    """The partitions of a Kafka source offset in a progress report (JSON, or None)."""
    if not offsets:
        return set()
    try:
        by_topic = json.loads(offsets)
    except ValueError:
        return set()
    if not isinstance(by_topic, dict):
        return set()
    return {
        (topic, int(p))
        for topic, partitions in by_topic.items()
        if isinstance(partitions, dict)
        for p in partitions
        if str(p).lstrip("-").isdigit()
    }


class VanishedPartitions:
    """Fed each progress report's (startOffset, endOffset); says which partitions went."""

    def __init__(self) -> None:
        self._known: set[tuple[str, int]] = set()
        self._said: set[tuple[str, int]] = set()  # gone, and not back since

    def see(self, start: str | None, end: str | None) -> list[tuple[str, int]]:
        """The partitions known before that this report's end no longer has, logged once (the
        same report is read again until the next one comes)."""
        ended = _partitions(end)
        self._known |= _partitions(start) - self._said
        if not ended:  # no batch planned yet: nothing known to compare with
            return []
        self._said -= ended  # made again: watched again
        gone = sorted(self._known - ended)
        self._known = ended
        self._said.update(gone)
        if gone:
            logger.warning(
                "%s left the Kafka source (deleted, or its ACLs now hide it): the "
                "reconciliation goes on without it. What was read from it stays judged; a "
                "ledger row whose copy there was not read yet may be reported missing",
                ", ".join(f"{t}[{p}]" for t, p in gone),
            )
        return gone

    def see_all(self, reports: Iterable[tuple[str | None, str | None]]) -> list[tuple[str, int]]:
        return [gone for start, end in reports for gone in self.see(start, end)]
