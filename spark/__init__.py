"""Reconciliation of the outbox, op markers and delivered topics with PySpark Structured Streaming.

This package is named `spark`, never `pyspark`, so it cannot shadow PySpark itself.
"""
