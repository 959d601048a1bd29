"""The checker: asks producers about stale half (prepared) records, RocketMQ-style check-back."""
