"""Settings of the checker: check-back limits (RocketMQ's names in brackets) and endpoints.

Producer groups map to check endpoints here, in the sidecar's configuration, never in a row: a
record only names its producer group, so a writer cannot make the checker call an address of its
choosing.
"""

from __future__ import annotations

from datetime import timedelta

from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field, SecretStr


class EndpointSettings(BaseModel):
    """One producer group's check endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: AnyHttpUrl
    secrets: list[SecretStr] = Field(
        min_length=1, description="Signing secrets (whsec_...), newest first, for rotation."
    )
    connect_timeout: timedelta = timedelta(seconds=2)
    timeout: timedelta = Field(default=timedelta(seconds=5), description="Whole request.")
    concurrency: int = Field(default=4, ge=1, le=256)
    max_response_bytes: int = Field(default=65_536, gt=0)


class CheckerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    check_immunity: timedelta = Field(
        default=timedelta(seconds=6), description="[transactionTimeOut] first check after this."
    )
    check_interval: timedelta = Field(
        default=timedelta(seconds=30), description="[transactionCheckInterval]"
    )
    max_checks: int = Field(default=15, ge=1, description="[transactionCheckMax]")
    max_prepared_age: timedelta = Field(
        default=timedelta(hours=72), description="[fileReservedTime] discard after this."
    )
    backoff_multiplier: float = Field(default=2.0, ge=1.0)
    max_backoff: timedelta = timedelta(minutes=10)
    batch_size: int = Field(default=100, ge=1, description="Transactions claimed per round.")
    dead_letter_topic: str = "outbox.dead-letter"
    endpoints: dict[str, EndpointSettings] = Field(
        default_factory=dict, description="producer group -> its check endpoint"
    )
