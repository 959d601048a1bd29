"""Settings of the checker: check-back limits (RocketMQ's names in brackets) and endpoints.

Producer groups map to check endpoints here, in the sidecar's configuration, never in a row: a
record only names its producer group, so a writer cannot make the checker call an address of its
choosing.

How the times fit together, for one prepared transaction:

- first check: ``check_immunity`` after its first record was prepared (a record's own
  ``check_immunity`` overrides it);
- a check is claimed (counted, and leased until ``endpoint.timeout + lease_margin``) before the
  request goes out, so a checker that dies mid-check leaves the transaction due again at the end
  of the lease, and several checkers never ask about the same transaction at once;
- after UNKNOWN or a failed check: ``check_interval * backoff_multiplier ** (checks - 1)``, at most
  ``max_backoff``, shortened by up to ``backoff_jitter`` (a fraction) so retries spread out;
- after ``max_checks`` checks without a decision, or once older than ``max_prepared_age``, the
  transaction is discarded (the relay ships it to the dead-letter topic). A check counts once its
  outcome (an answer, a timeout, an error) is recorded; one lost with its checker (killed or cut
  from the database mid-check) is asked again when its lease ends, not counted.

So an enabled checker refuses a ``max_prepared_age`` not longer than ``check_immunity`` (nothing
would ever be asked) and a ``check_interval`` above ``max_backoff`` (it would never count).
"""

from __future__ import annotations

import ssl
from datetime import timedelta
from typing import Self
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)

from outbox._dsn import MASK
from outbox._errors import InvalidProducerGroupError
from outbox._records import check_producer_group
from outbox.checkback import Signer
from relay.durations import Duration, iso_days


class EndpointSettings(BaseModel):
    """One producer group's check endpoint."""

    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    url: AnyHttpUrl = Field(
        description="POST target; https is verified against the system CAs (or ca_file). "
        "Redirects are never followed."
    )
    secrets: list[SecretStr] = Field(
        min_length=1,
        description=(
            "Signing secrets (whsec_...): each signs every request, and an answer signed with "
            "any is accepted, so either side may take a new one first."
        ),
    )
    connect_timeout: Duration = Field(
        default=timedelta(seconds=2),
        description="Name lookup and TCP connect, all addresses tried included; each read of the"
        " TLS handshake.",
    )
    timeout: Duration = Field(
        default=timedelta(seconds=5),
        description="Whole request, connect included: after this the answer is not waited for.",
    )
    concurrency: int = Field(
        default=4, ge=1, le=256, description="Requests in flight at once to this endpoint."
    )
    max_response_bytes: int = Field(
        default=65_536, gt=0, description="A longer answer is refused unread."
    )
    ca_file: str | None = Field(
        default=None,
        description="PEM bundle of the CAs to trust for https, instead of the system's.",
    )
    signature_tolerance: Duration = Field(
        default=timedelta(seconds=300),
        ge=timedelta(seconds=1),
        le=timedelta(hours=1),
        description="How far an answer's signed time may be from the checker's clock; as the "
        "application's handler's tolerance_s (raised there to ride out clock skew, every "
        "answer was refused here at 300 s).",
    )

    @field_validator("url")
    @classmethod
    def _no_credentials(cls, url: AnyHttpUrl) -> AnyHttpUrl:
        if url.username or url.password:
            raise ValueError(
                "the URL holds credentials: the checker never sends them (its requests are "
                "signed with `secrets`), and `outboxctl config` would print them; remove them"
            )
        return url

    @field_serializer("url", when_used="json")
    def _query_masked(self, url: AnyHttpUrl) -> str:
        return self.shown_url

    @property
    def shown_url(self) -> str:
        """The URL with its query's values masked, as `outboxctl config` and the logs show it:
        an API key or a function's code often rides there (?code=...)."""
        if not self.url.query:
            return str(self.url)
        pairs = parse_qsl(self.url.query, keep_blank_values=True)
        masked = "&".join(f"{quote(name)}={MASK}" for name, _ in pairs)
        return urlunsplit(urlsplit(str(self.url))._replace(query=masked))

    def ca_file_problem(self) -> str | None:
        """Why its ca_file cannot be used, if it cannot: missing or not PEM, it passed
        `outboxctl config`, then failed every check (a traceback, or "No such file or
        directory" naming neither the file nor the setting)."""
        if self.ca_file is None:
            return None
        if self.url.scheme != "https":
            return f"ca_file is for an https URL; this one is {self.url.scheme}"
        try:
            ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            return f"ca_file {self.ca_file} cannot be used: {why}"
        return None

    @model_validator(mode="after")
    def _timeouts(self) -> Self:
        if self.connect_timeout <= timedelta(0) or self.timeout <= timedelta(0):
            raise ValueError("connect_timeout and timeout must be positive")
        if self.connect_timeout > self.timeout:
            raise ValueError("connect_timeout must not exceed timeout (the whole request)")
        return self


class CheckerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, hide_input_in_errors=True)

    enabled: bool = True
    check_immunity: Duration = Field(
        default=timedelta(seconds=6), description="[transactionTimeOut] first check after this."
    )
    check_interval: Duration = Field(
        default=timedelta(seconds=30),
        description="[transactionCheckInterval] wait after the first UNKNOWN; grows by "
        "backoff_multiplier per further check.",
    )
    max_checks: int = Field(default=15, ge=1, description="[transactionCheckMax]")
    max_prepared_age: Duration = Field(
        default=timedelta(hours=72), description="[fileReservedTime] discard after this."
    )
    backoff_multiplier: float = Field(default=2.0, ge=1.0)
    max_backoff: Duration = timedelta(minutes=10)
    backoff_jitter: float = Field(
        default=0.1, ge=0.0, lt=1.0, description="Each wait is shortened by up to this fraction."
    )
    batch_size: int = Field(default=100, ge=1, description="Transactions claimed per round.")
    poll_interval: Duration = Field(
        default=timedelta(seconds=1),
        description="Pause between rounds when the last one found less than a full batch.",
    )
    lease_margin: Duration = Field(
        default=timedelta(seconds=10),
        description="A claimed check is leased for the endpoint's timeout plus this; a request "
        "that could not start within this margin is given back uncounted.",
    )
    circuit_failure_threshold: int = Field(
        default=5, ge=1, description="Consecutive failed checks that open an endpoint's circuit."
    )
    circuit_cooldown: Duration = Field(
        default=timedelta(seconds=30),
        description="An open circuit lets one probe through after this.",
    )
    request_max_records: int = Field(
        default=100, ge=1, description="Records summarised in one check request (the first ones)."
    )
    request_max_bytes: int = Field(
        default=256 * 1024,
        ge=4096,
        description="A check request's body stays under this: records past it are left out "
        "(its record_count says how many there are). Keep it under the endpoint's limit "
        "(outbox.checkback's max_body_bytes, 1 MiB by default).",
    )
    metrics_interval: Duration = Field(
        default=timedelta(seconds=15),
        description="The prepared-records-by-age gauges (a pass over prepared rows) are "
        "refreshed at most this often.",
    )
    endpoints: dict[str, EndpointSettings] = Field(
        default_factory=dict,
        description="producer group -> its check endpoint; a group matches whatever the case",
    )

    @field_validator("endpoints")
    @classmethod
    def _one_per_group(cls, endpoints: dict[str, EndpointSettings]) -> dict[str, EndpointSettings]:
        """Producer groups match endpoints whatever the case (environment variables and secret
        file names carry none: the sidecar's settings fold endpoint names in every source), so
        two names differing only by case would be one group's two endpoints."""
        by_folded: dict[str, list[str]] = {}
        for name in endpoints:
            try:  # else taken, and never matched: that group's records discarded at max age
                check_producer_group(name)
            except InvalidProducerGroupError as exc:
                raise ValueError(
                    f"endpoints.{name}: no producer group has this name: {exc}"
                ) from None
            by_folded.setdefault(name.casefold(), []).append(name)
        for names in by_folded.values():
            if len(names) > 1:
                raise ValueError(
                    f"endpoints {', '.join(map(repr, sorted(names)))} differ only by case: "
                    "producer groups match endpoints whatever the case; give one of them"
                )
        return endpoints

    @model_validator(mode="after")
    def _positive_times(self) -> Self:
        # poll_interval 0 would spin on the due query; lease_margin 0 would give back every
        # claimed check uncounted, since no request can start within no time
        positive = ("check_interval", "max_prepared_age", "max_backoff", "circuit_cooldown")
        for name in (*positive, "poll_interval", "lease_margin"):
            if getattr(self, name) <= timedelta(0):
                raise ValueError(f"{name} must be positive")
        for name in ("check_immunity", "metrics_interval"):
            if getattr(self, name) < timedelta(0):
                raise ValueError(f"{name} must not be negative")
        if self.enabled:  # a relay alone runs whatever a checker it does not run would refuse
            self._usable()
        return self

    def _usable(self) -> None:
        """What only contradicts itself once the checker runs: refused when it is built, with a
        traceback that named no setting and took the whole sidecar down (relay included),
        while `outboxctl config` said all was well; or never said, only acted on."""
        for group, endpoint in self.endpoints.items():
            if problem := endpoint.ca_file_problem():
                raise ValueError(f"endpoints.{group}.{problem}")
            for i, secret in enumerate(endpoint.secrets):
                try:
                    Signer(secret)  # decodes the key as the checker will
                except ValueError as exc:  # its message never holds the secret
                    raise ValueError(
                        f"endpoints.{group}.secrets: secret {i + 1} of "
                        f"{len(endpoint.secrets)}: {exc}"
                    ) from None
        if self.max_prepared_age <= self.check_immunity:
            raise ValueError(
                f"max_prepared_age ({iso_days(self.max_prepared_age)}) must be longer than "
                f"check_immunity ({iso_days(self.check_immunity)}): every prepared transaction "
                "would be discarded unasked, its producer never checked"
            )
        if self.check_interval > self.max_backoff:
            raise ValueError(
                f"check_interval ({iso_days(self.check_interval)}) must not exceed max_backoff "
                f"({iso_days(self.max_backoff)}), which caps every wait between checks"
            )
