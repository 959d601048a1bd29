"""The counters that alerts watch with increase() exist at 0 from the start: a series that first
shows at 1 has no increase, and the first parking or discard since a start went unalerted."""

from __future__ import annotations

import base64

from prometheus_client import REGISTRY


def test_every_parking_reason_is_counted_from_0() -> None:
    from relay import shard

    kinds = [kind for _, kind in shard._REASON_KINDS] + ["other"]
    assert len(kinds) > 2
    for kind in kinds:
        sample = REGISTRY.get_sample_value("outbox_relay_records_parked_total", {"reason": kind})
        assert sample is not None, kind


def test_every_discard_of_every_group_and_every_rounds_result_are_counted_from_0() -> None:
    from checker import Checker, CheckerSettings

    secret = "whsec_" + base64.b64encode(b"z" * 32).decode()
    settings = CheckerSettings.model_validate(
        {"endpoints": {"zero-group": {"url": "http://127.0.0.1:9/check", "secrets": [secret]}}}
    )
    checker = Checker(settings, "postgresql://nobody@127.0.0.1:9/none")  # never connects here
    try:
        for group in ("zero-group", "other"):
            for limit in ("max_checks", "max_age"):
                labels = {"producer_group": group, "limit": limit}
                value = REGISTRY.get_sample_value("outbox_checker_discards_total", labels)
                assert value is not None, labels
        for result in ("ok", "error"):  # OutboxCheckerFailing: the first failed round
            value = REGISTRY.get_sample_value("outbox_checker_rounds_total", {"result": result})
            assert value is not None, result
    finally:
        checker.stop()
