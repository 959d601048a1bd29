"""The type of the sidecar's duration settings: ISO 8601 text (or a number of seconds in the
TOML file), of a fixed length, bounded.

pydantic takes `P1M` as 30 days and `P1Y` as 365: a month meant is not what is used. And a
duration of thousands of years put timestamps out of Postgres's range: every relay round (the
retentions) or checker round (the maximum prepared age) failed with "timestamp out of range",
after `outboxctl config` had printed the setting as fine.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator

MAX_DURATION = timedelta(days=36_500)


def _fixed_length(value: Any) -> Any:
    if isinstance(value, str):
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


Duration = Annotated[timedelta, BeforeValidator(_fixed_length), AfterValidator(_bounded)]
