"""Checker settings, small helpers, and the public surface of the `checker` package."""

from __future__ import annotations

import base64
import importlib
import json
from datetime import timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

import checker
from checker._claim import wire_headers
from checker.config import CheckerSettings, EndpointSettings
from checker.service import CheckRoundResult, _duration
from relay.config import SidecarSettings, load_settings

SECRET = "whsec_" + base64.b64encode(b"k" * 32).decode()


def endpoint(**overrides: object) -> dict[str, object]:
    return {"url": "https://orders.internal/outbox/check", "secrets": [SECRET], **overrides}


def test_defaults_are_rocketmqs() -> None:
    s = CheckerSettings()
    assert s.check_immunity == timedelta(seconds=6)
    assert s.max_checks == 15
    assert s.max_prepared_age == timedelta(hours=72)
    assert s.endpoints == {}


def test_secrets_are_masked() -> None:
    s = CheckerSettings(endpoints={"orders": endpoint()})
    assert SECRET not in repr(s)
    assert SECRET not in s.model_dump_json()
    assert s.endpoints["orders"].secrets[0].get_secret_value() == SECRET


@pytest.mark.parametrize(
    "bad",
    [
        {"secrets": []},
        {"connect_timeout": "PT10S", "timeout": "PT5S"},
        {"timeout": "PT0S"},
        {"concurrency": 0},
        {"url": "ftp://x/y"},
        {"unexpected": 1},
    ],
)
def test_endpoint_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        EndpointSettings.model_validate(endpoint(**bad))


def test_an_endpoint_url_with_credentials_is_refused_without_echoing_them() -> None:
    """They were never sent (a basic-auth endpoint answered 401 to every check), and
    `outboxctl config` printed them."""
    with pytest.raises(ValidationError, match="the URL holds credentials") as caught:
        EndpointSettings.model_validate(endpoint(url="https://app:s3cret@orders.internal/check"))
    assert "s3cret" not in str(caught.value)


def test_an_endpoint_urls_query_is_masked_where_it_is_shown() -> None:
    """An API key or a function's code rides in a query string (Azure Functions' ?code=):
    `outboxctl config` printed it; the requests still carry it."""
    settings = EndpointSettings.model_validate(
        endpoint(url="https://fn.example/api/check?code=s3cret&v=2")
    )
    shown = json.loads(settings.model_dump_json())["url"]
    assert shown == "https://fn.example/api/check?code=**********&v=**********"
    assert str(settings.url) == "https://fn.example/api/check?code=s3cret&v=2"


def test_a_ca_file_that_cannot_be_used_is_refused_naming_it(tmp_path: Path) -> None:
    """Missing or not PEM, it passed `outboxctl config`, then every check failed with a
    traceback or "No such file or directory" naming neither the file nor the setting."""
    missing, not_pem = tmp_path / "missing.pem", tmp_path / "ca.txt"
    not_pem.write_text("not a certificate\n")

    def checker(url: str, ca_file: Path, enabled: bool = True) -> CheckerSettings:
        given = {"orders": endpoint(url=url, ca_file=str(ca_file))}
        return CheckerSettings.model_validate({"enabled": enabled, "endpoints": given})

    for path, why in [(missing, "No such file or directory"), (not_pem, "NO_CERTIFICATE")]:
        said = f"endpoints.orders.ca_file {path} cannot be used: .*{why}"
        with pytest.raises(ValidationError, match=said):
            checker("https://x/y", path)
    with pytest.raises(ValidationError, match="ca_file is for an https URL; this one is http"):
        checker("http://x/y", not_pem)
    # a relay alone (the checker off) runs whatever its checker's endpoints would need
    assert not checker("https://x/y", missing, enabled=False).enabled


@pytest.mark.parametrize(
    "bad",
    [
        {"check_interval": "PT0S"},
        {"backoff_jitter": 1.0},
        {"max_checks": 0},
        {"lease_margin": "-PT1S"},
        {"lease_margin": "PT0S"},  # every claimed check would be given back unasked
        {"poll_interval": "PT0S"},  # the due query in a busy loop
        {"check_immunity": "-PT1S"},
    ],
)
def test_checker_rejects(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        CheckerSettings.model_validate(bad)


@pytest.mark.parametrize(
    ("bad", "said"),
    [
        # every prepared transaction was discarded before its first check
        # in ISO 8601, as they are given (not Python's 0:00:02)
        (
            {"check_immunity": "PT6S", "max_prepared_age": "PT2S"},
            r"max_prepared_age \(PT2S\) must be longer than check_immunity \(PT6S\)",
        ),
        ({"check_immunity": "PT6S", "max_prepared_age": "PT6S"}, "must be longer than"),
        # the interval was ignored: every wait was max_backoff
        (
            {"check_interval": "PT20M", "max_backoff": "PT10M"},
            r"check_interval \(PT20M\) must not exceed max_backoff \(PT10M\)",
        ),
    ],
)
def test_checker_times_that_contradict_each_other_are_refused(
    bad: dict[str, object], said: str
) -> None:
    with pytest.raises(ValidationError, match=said):
        CheckerSettings.model_validate(bad)
    # not for a relay whose checker is off: it ran with them before they were refused
    assert not CheckerSettings.model_validate({**bad, "enabled": False}).enabled


@pytest.mark.parametrize(
    ("secret", "said"),
    [
        ("nope", "secret 2 of 2: secret text must have the form"),
        ("whsec_a2V5", "secret 2 of 2: secret key is 3 bytes"),
        ("whsec_!!!", "secret 2 of 2: secret after 'whsec_' is not valid base64"),
    ],
)
def test_an_unusable_secret_is_refused_with_the_settings(secret: str, said: str) -> None:
    """It passed `outboxctl config` and stopped the sidecar when the checker was built, with a
    traceback that named no setting."""
    with pytest.raises(ValidationError, match=said) as caught:
        SidecarSettings.model_validate(
            {"checker": {"endpoints": {"orders": endpoint(secrets=[SECRET, secret])}}}
        )
    assert "endpoints.orders.secrets: " + said in str(caught.value)
    disabled = {"enabled": False, "endpoints": {"orders": endpoint(secrets=[SECRET, secret])}}
    assert not CheckerSettings.model_validate(disabled).enabled
    assert secret not in str(caught.value).replace(said, "")


def test_endpoints_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OUTBOX_DATABASE__DSN", "postgresql://x@h/db")
    monkeypatch.setenv(
        "OUTBOX_CHECKER__ENDPOINTS",
        json.dumps({"orders": {"url": "http://127.0.0.1:8081/outbox/check", "secrets": [SECRET]}}),
    )
    monkeypatch.setenv("OUTBOX_CHECKER__MAX_CHECKS", "3")
    s = SidecarSettings()
    assert s.checker.max_checks == 3
    assert str(s.checker.endpoints["orders"].url) == "http://127.0.0.1:8081/outbox/check"


def test_an_endpoint_named_in_mixed_case_is_one_endpoint_across_file_environment_and_secrets(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Environment variables and secret file names reach the settings lower-cased; the config
    file keeps the case. The url in the file and the secret in a mounted file (the chart's
    layout) are one endpoint, and the environment's fields win over the file's."""
    config = tmp_path / "sidecar.toml"
    config.write_text(
        '[database]\ndsn = "postgresql://x@h/db"\n'
        '[checker.endpoints.OrderService]\nurl = "http://file.internal/outbox/check"\n'
        "timeout = 'PT3S'\n"
    )
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "outbox_checker__endpoints__OrderService__secrets").write_text(f'["{SECRET}"]\n')
    monkeypatch.setenv("OUTBOX_SECRETS_DIR", str(secrets))
    monkeypatch.setenv("OUTBOX_CHECKER__ENDPOINTS__ORDERSERVICE__TIMEOUT", "PT7S")
    s = load_settings(config)
    assert list(s.checker.endpoints) == ["orderservice"]
    endpoint = s.checker.endpoints["orderservice"]
    assert str(endpoint.url) == "http://file.internal/outbox/check"
    assert endpoint.timeout == timedelta(seconds=7)  # the environment's
    assert [x.get_secret_value() for x in endpoint.secrets] == [SECRET]
    # a JSON value in the environment keeps its case, and still wins over the file
    monkeypatch.setenv(
        "OUTBOX_CHECKER__ENDPOINTS",
        json.dumps({"ORDERService": {"url": "http://env.internal/outbox/check"}}),
    )
    endpoint = load_settings(config).checker.endpoints["orderservice"]
    assert str(endpoint.url) == "http://env.internal/outbox/check"


def test_endpoints_differing_only_by_case_are_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="'ORDERS', 'Orders' differ only by case"):
        CheckerSettings.model_validate({"endpoints": {"Orders": endpoint(), "ORDERS": endpoint()}})


def test_wire_headers_first_wins_and_text() -> None:
    stored = [
        ["trace", base64.b64encode(b"abc").decode()],
        ["trace", base64.b64encode(b"second").decode()],
        ["empty", None],
        ["binary", base64.b64encode(b"\xff\xfe").decode()],
    ]
    assert wire_headers(stored) == {"trace": "abc", "empty": "", "binary": "\ufffd\ufffd"}
    assert wire_headers("garbage") == {}


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (timedelta(hours=72), "72h"),
        (timedelta(minutes=90), "90m"),
        (timedelta(seconds=45), "45s"),
        (timedelta(days=14), "14d"),
        (timedelta(seconds=1.5), "1.5s"),
    ],
)
def test_duration_reads_well(value: timedelta, text: str) -> None:
    assert _duration(value) == text


def test_round_result_counts() -> None:
    r = CheckRoundResult(checked=5)
    r.outcomes.update({"commit": 2, "unknown": 1, "timeout": 2})
    assert (r.committed, r.rolled_back, r.unknown, r.failed) == (2, 0, 1, 2)
    assert r.as_dict()["outcomes"] == {"commit": 2, "unknown": 1, "timeout": 2}


def test_all_is_complete() -> None:
    module = importlib.import_module("checker")
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "checker").startswith("checker")
        and not isinstance(value, type(importlib))
    }
    assert set(checker.__all__) >= public, public - set(checker.__all__)
    assert all(hasattr(checker, name) for name in checker.__all__)


@pytest.mark.parametrize("name", ["a b", "orders/eu", "x" * 129])
def test_an_endpoint_no_producer_group_can_have_is_refused_by_name(name: str) -> None:
    """Taken, it matched no group ever: that group's transactions were discarded at their
    maximum age, and `outboxctl config` showed the setting as fine (found by a review)."""
    with pytest.raises(ValidationError, match=r"endpoints\..*: no producer group has this name"):
        CheckerSettings.model_validate({"endpoints": {name: endpoint()}})
