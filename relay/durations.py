"""The type of the sidecar's duration settings: ISO 8601 text or a number of seconds, of a
fixed length, bounded; printed as ISO 8601 in days at most, as it is read.

pydantic takes `P1M` as 30 days and `P1Y` as 365: a month meant is not what is used. And a
duration of thousands of years put timestamps out of Postgres's range: every relay round (the
retentions) or checker round (the maximum prepared age) failed with "timestamp out of range",
after `outboxctl config` had printed the setting as fine.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, PlainSerializer

MAX_DURATION = timedelta(days=36_500)


# A number of seconds, as TOML gives one: from the environment or a secret file it is text, and
# pydantic refused "25" there (the chart, reading the grace as TOML does, passed it on).
_SECONDS = re.compile(r"\s*[+-]?[0-9]+(\.[0-9]+)?\s*")


def _fixed_length(value: Any) -> Any:
    if isinstance(value, str):
        if _SECONDS.fullmatch(value):
            return float(value)
        text = value.strip().upper().lstrip("+-")
        if text.startswith("P") and any(unit in text.partition("T")[0] for unit in "YM"):
            raise ValueError(
                f"{value!r}: months and years have no fixed length (they would be taken as 30 "
                "and 365 days); give days, e.g. P30D"
            )
    return value


def _bounded(value: timedelta) -> timedelta:
    if abs(value) > MAX_DURATION:
        raise ValueError(
            f"at most {MAX_DURATION.days} days: timestamps that far off are out of Postgres's range"
        )
    return value


def iso_days(value: timedelta) -> str:
    """ISO 8601 in days at most: pydantic wrote 365 days and more with years (`P1Y35D`), which
    this type refuses, so `outboxctl config`'s output could not be given back as settings."""
    sign = "-" if value < timedelta(0) else ""
    value = abs(value)
    days, rest = value.days, value - timedelta(days=value.days)
    hours, rest = divmod(rest, timedelta(hours=1))
    minutes, rest = divmod(rest, timedelta(minutes=1))
    seconds = f"{rest.total_seconds():.6f}".rstrip("0").rstrip(".")
    time = "".join(f"{n}{unit}" for n, unit in ((hours, "H"), (minutes, "M")) if n) + (
        f"{seconds}S" if seconds != "0" else ""
    )
    if not days and not time:
        return "PT0S"
    return f"{sign}P{f'{days}D' if days else ''}{f'T{time}' if time else ''}"


Duration = Annotated[
    timedelta,
    BeforeValidator(_fixed_length),
    AfterValidator(_bounded),
    PlainSerializer(iso_days, return_type=str, when_used="json"),
]
