"""Reconciliation of the outbox, op markers and delivered topics with PySpark Structured Streaming.

This package is named `spark`, never `pyspark`, so it cannot shadow PySpark itself.

What is importable without PySpark (for `outboxctl findings`): the settings, the errors and the
findings reader exported here. The job itself is `spark.job` (`main(argv)`, `ReconcileJob`), its
transformations `spark.transform`; both need PySpark.
"""

from spark._errors import ReconcileConfigError, ReconcileError, ReconcileQueryError
from spark.config import FINDING_KINDS, JudgeWindow, ReconcileSettings, parse_duration
from spark.findings import Finding, WindowSummary, read_findings, read_windows

__all__ = [
    "FINDING_KINDS",
    "Finding",
    "JudgeWindow",
    "ReconcileConfigError",
    "ReconcileError",
    "ReconcileQueryError",
    "ReconcileSettings",
    "WindowSummary",
    "parse_duration",
    "read_findings",
    "read_windows",
]
