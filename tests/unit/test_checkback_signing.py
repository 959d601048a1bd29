"""Standard Webhooks signing and verification for the check-back."""

from __future__ import annotations

import base64
import math
import threading

import pytest
from pydantic import SecretStr

import outbox
import outbox.checkback as checkback
from outbox.checkback import (
    HEADER_ID,
    HEADER_SIGNATURE,
    HEADER_TIMESTAMP,
    CheckHandler,
    InMemoryReplayCache,
    ReplayedMessage,
    SignatureInvalid,
    SignatureMissing,
    Signer,
    TimestampOutsideTolerance,
    TransactionStatus,
    Verifier,
    generate_secret,
)
from outbox.checkback._signing import decode_secret

# The official Standard Webhooks test vector (standard-webhooks libraries' tests).
VECTOR_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
VECTOR_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
VECTOR_TS = 1614265330
VECTOR_BODY = b'{"test": 2432232314}'
VECTOR_SIGNATURE = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="

OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
NEW = "whsec_" + base64.b64encode(b"n" * 32).decode()
T0 = 1_700_000_000
BODY = b'{"tx_id": "t-1"}'


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_official_vector_signs_byte_for_byte() -> None:
    headers = Signer(VECTOR_SECRET).sign(VECTOR_ID, VECTOR_TS, VECTOR_BODY)
    assert headers == {
        HEADER_ID: VECTOR_ID,
        HEADER_TIMESTAMP: str(VECTOR_TS),
        HEADER_SIGNATURE: VECTOR_SIGNATURE,
    }


def test_official_vector_verifies() -> None:
    verifier = Verifier([VECTOR_SECRET], now=Clock(VECTOR_TS))
    headers = {
        HEADER_ID: VECTOR_ID,
        HEADER_TIMESTAMP: str(VECTOR_TS),
        HEADER_SIGNATURE: VECTOR_SIGNATURE,
    }
    verifier.verify(headers, VECTOR_BODY)
    with pytest.raises(SignatureInvalid):
        Verifier([VECTOR_SECRET], now=Clock(VECTOR_TS)).verify(headers, VECTOR_BODY + b" ")


def test_round_trip_with_case_insensitive_headers() -> None:
    headers = Signer(NEW).sign("msg_1", T0, BODY)
    shouted = {name.title(): value for name, value in headers.items()}
    assert HEADER_ID not in shouted
    Verifier([NEW], now=Clock(T0)).verify(shouted, BODY)


def test_secret_forms() -> None:
    key = b"k" * 32
    as_text = "whsec_" + base64.b64encode(key).decode()
    assert decode_secret(as_text) == key
    assert decode_secret(key) == key
    assert decode_secret(SecretStr(as_text)) == key
    headers = Signer(key).sign("msg_1", T0, BODY)
    Verifier([as_text], now=Clock(T0)).verify(headers, BODY)


@pytest.mark.parametrize(
    ("secret", "message"),
    [
        ("MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "must have the form"),
        ("whsec_not*base64!", "not valid base64"),
        ("whsec_" + base64.b64encode(b"short").decode(), "at least 16"),
        (b"", "at least 16"),
    ],
)
def test_bad_secrets_are_refused_without_echoing_them(secret: str | bytes, message: str) -> None:
    with pytest.raises(outbox.InvalidConfigError, match=message) as info:  # an OutboxError
        Signer(secret)
    text = secret if isinstance(secret, str) else secret.decode()
    if text:
        assert text.removeprefix("whsec_") not in str(info.value)


@pytest.mark.parametrize("secrets", [[], (), NEW, SecretStr(NEW)])
def test_verifier_needs_a_list_of_secrets(secrets: object) -> None:
    with pytest.raises(outbox.InvalidConfigError, match="non-empty list of secrets"):
        Verifier(secrets)  # type: ignore[arg-type]


def test_generated_secret_is_usable() -> None:
    secret = generate_secret()
    assert secret.startswith("whsec_")
    assert len(decode_secret(secret)) == 32
    assert generate_secret() != secret


def test_rotation_accepts_old_secret_while_configured() -> None:
    headers = Signer(OLD).sign("msg_1", T0, BODY)
    Verifier([NEW, OLD], now=Clock(T0)).verify(headers, BODY)
    with pytest.raises(SignatureInvalid, match="no signature matches"):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


def test_a_signer_of_several_secrets_is_accepted_by_a_receiver_of_any_of_them() -> None:
    """Either side of a check may take a new secret first, or drop the old one first."""
    headers = Signer([NEW, OLD]).sign("msg_1", T0, BODY)
    assert len(headers[HEADER_SIGNATURE].split(" ")) == 2
    for receiver in ([OLD], [NEW], [NEW, OLD]):
        Verifier(receiver, now=Clock(T0)).verify(headers, BODY)
    with pytest.raises(SignatureInvalid, match="no signature matches"):
        Verifier([generate_secret()], now=Clock(T0)).verify(headers, BODY)
    with pytest.raises(outbox.InvalidConfigError, match="at least one secret"):
        Signer([])


def test_any_of_several_signatures_may_match() -> None:
    good = Signer(NEW).sign("msg_1", T0, BODY)
    forged = Signer(OLD).sign("msg_1", T0, BODY)[HEADER_SIGNATURE]
    both = {**good, HEADER_SIGNATURE: f"v2,abc v1,!!! {forged} {good[HEADER_SIGNATURE]}"}
    Verifier([NEW], now=Clock(T0)).verify(both, BODY)


def test_forged_signature_is_rejected() -> None:
    headers = Signer(OLD).sign("msg_1", T0, BODY)
    with pytest.raises(SignatureInvalid, match="no signature matches"):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


@pytest.mark.parametrize(
    "tamper",
    [
        {HEADER_ID: "msg_2"},
        {HEADER_TIMESTAMP: str(T0 + 1)},
    ],
)
def test_signature_covers_id_and_timestamp(tamper: dict[str, str]) -> None:
    headers = {**Signer(NEW).sign("msg_1", T0, BODY), **tamper}
    with pytest.raises(SignatureInvalid):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


def test_signature_without_v1_entry_is_invalid() -> None:
    headers = Signer(NEW).sign("msg_1", T0, BODY)
    headers[HEADER_SIGNATURE] = headers[HEADER_SIGNATURE].replace("v1,", "v2,")
    with pytest.raises(SignatureInvalid, match="no well-formed 'v1,<base64>'"):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


@pytest.mark.parametrize("missing", [HEADER_ID, HEADER_TIMESTAMP, HEADER_SIGNATURE])
def test_missing_header_is_named(missing: str) -> None:
    headers = Signer(NEW).sign("msg_1", T0, BODY)
    del headers[missing]
    with pytest.raises(SignatureMissing, match=f"^{missing} header is missing"):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


# The last one is Arabic-Indic digits: str.isdigit() says yes, but it is not ASCII.
@pytest.mark.parametrize("timestamp", ["1700000000.5", "-1", "soon", "\u0661\u0667" + "\u0660" * 8])
def test_malformed_timestamp_is_invalid(timestamp: str) -> None:
    headers = {**Signer(NEW).sign("msg_1", T0, BODY), HEADER_TIMESTAMP: timestamp}
    with pytest.raises(SignatureInvalid, match="webhook-timestamp header must be integer"):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


@pytest.mark.parametrize("msg_id", ["a.b", "", "x" * 257, "msg 1"])
def test_ids_outside_the_safe_alphabet_are_refused(msg_id: str) -> None:
    with pytest.raises(ValueError, match="message id"):
        Signer(NEW).sign(msg_id, T0, BODY)


def test_tolerance_window_both_ways() -> None:
    headers = Signer(NEW).sign("msg_1", T0, BODY)
    Verifier([NEW], now=Clock(T0 + 300)).verify(headers, BODY)  # edge: still inside
    Verifier([NEW], now=Clock(T0 - 300)).verify(headers, BODY)
    with pytest.raises(TimestampOutsideTolerance, match="301s old; tolerance is 300s"):
        Verifier([NEW], now=Clock(T0 + 301)).verify(headers, BODY)
    with pytest.raises(TimestampOutsideTolerance, match="301s in the future"):
        Verifier([NEW], now=Clock(T0 - 301)).verify(headers, BODY)
    with pytest.raises(TimestampOutsideTolerance, match="tolerance is 10s"):
        Verifier([NEW], tolerance_s=10, now=Clock(T0 + 11)).verify(headers, BODY)


def test_replay_within_window_is_rejected() -> None:
    clock = Clock(T0)
    verifier = Verifier([NEW], now=clock)
    headers = Signer(NEW).sign("msg_1", T0, BODY)
    verifier.verify(headers, BODY)
    clock.t = T0 + 299
    with pytest.raises(ReplayedMessage, match="already used"):
        verifier.verify(headers, BODY)


def test_replay_of_future_stamped_message_is_caught_for_its_whole_validity() -> None:
    # Stamped 300 s ahead: valid until now+600, so the id must be remembered that long.
    clock = Clock(T0)
    verifier = Verifier([NEW], now=clock)
    headers = Signer(NEW).sign("msg_1", T0 + 300, BODY)
    verifier.verify(headers, BODY)
    clock.t = T0 + 599
    with pytest.raises(ReplayedMessage):
        verifier.verify(headers, BODY)


def test_same_id_after_expiry_is_not_a_replay() -> None:
    clock = Clock(T0)
    verifier = Verifier([NEW], now=clock)
    verifier.verify(Signer(NEW).sign("msg_1", T0, BODY), BODY)
    clock.t = T0 + 601
    verifier.verify(Signer(NEW).sign("msg_1", T0 + 601, BODY), BODY)


def test_forged_message_does_not_burn_the_id() -> None:
    verifier = Verifier([NEW], now=Clock(T0))
    with pytest.raises(SignatureInvalid):
        verifier.verify(Signer(OLD).sign("msg_1", T0, BODY), BODY)
    verifier.verify(Signer(NEW).sign("msg_1", T0, BODY), BODY)


def test_stale_message_does_not_burn_the_id() -> None:
    clock = Clock(T0 + 1000)
    verifier = Verifier([NEW], now=clock)
    with pytest.raises(TimestampOutsideTolerance):
        verifier.verify(Signer(NEW).sign("msg_1", T0, BODY), BODY)
    verifier.verify(Signer(NEW).sign("msg_1", T0 + 1000, BODY), BODY)


def test_replay_cache_expires_entries() -> None:
    cache = InMemoryReplayCache(ttl_s=10)
    assert cache.seen("a", 100) is False
    assert cache.seen("a", 110) is True
    assert cache.seen("b", 105) is False
    assert cache.seen("a", 111) is False  # expired, recorded again
    assert len(cache) == 2
    assert cache.seen("c", 200) is False
    assert len(cache) == 1  # a and b expired on the way


def test_a_replay_cache_sized_without_a_ttl_keeps_ids_for_its_verifiers_whole_window() -> None:
    """Given as its docstring advises (sized, ttl_s left out) to a verifier of a wider
    tolerance, the cache kept ids 600 s: a message stamped 800 s ahead, replayed 700 s after
    it was first seen, was accepted again."""
    clock = Clock(T0)
    cache = InMemoryReplayCache(max_entries=10)
    verifier = Verifier([NEW], tolerance_s=900, replay_cache=cache, now=clock)
    headers = Signer(NEW).sign("msg_1", T0 + 800, BODY)
    verifier.verify(headers, BODY)
    clock.t = T0 + 700
    with pytest.raises(ReplayedMessage):
        verifier.verify(headers, BODY)
    assert cache.ttl_s == 1800


def test_a_replay_cache_keeping_ids_shorter_than_twice_the_tolerance_is_refused() -> None:
    with pytest.raises(outbox.InvalidConfigError, match=r"give it ttl_s=1800 or more"):
        Verifier([NEW], tolerance_s=900, replay_cache=InMemoryReplayCache(ttl_s=600))
    Verifier([NEW], tolerance_s=300, replay_cache=InMemoryReplayCache(ttl_s=600))


@pytest.mark.parametrize("signature", ["v1,\xe9\xe9\xe9\xe9", "v1,\u00e9=", "v1,abc\x00"])
def test_a_signature_of_text_that_is_not_ascii_is_invalid_not_a_crash(signature: str) -> None:
    """base64 refused it with a plain ValueError, which escaped verify(): an unauthenticated
    client got no answer (or a bare 500) and wrote two tracebacks to the log."""
    headers = {**Signer(NEW).sign("msg_1", T0, BODY), HEADER_SIGNATURE: signature}
    with pytest.raises(SignatureInvalid, match="no well-formed"):
        Verifier([NEW], now=Clock(T0)).verify(headers, BODY)


def test_replay_cache_is_bounded_and_evicts_oldest() -> None:
    cache = InMemoryReplayCache(ttl_s=1000, max_entries=2)
    for msg_id in ("a", "b", "c"):
        assert cache.seen(msg_id, 1) is False
    assert len(cache) == 2
    assert cache.seen("c", 1) is True
    assert cache.seen("b", 1) is True
    assert cache.seen("a", 1) is False  # evicted


def test_replay_cache_records_once_across_threads() -> None:
    cache = InMemoryReplayCache()
    barrier = threading.Barrier(16)
    answers: list[bool] = []

    def check() -> None:
        barrier.wait()
        answers.append(cache.seen("same", 1))

    threads = [threading.Thread(target=check) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(answers) == [False] + [True] * 15


@pytest.mark.parametrize(
    ("ttl_s", "max_entries"), [(0, 10), (10, 0), (math.nan, 10), (math.inf, 10)]
)
def test_replay_cache_limits_must_be_positive(ttl_s: float, max_entries: int) -> None:
    """NaN passed `ttl_s <= 0`, and a cache of NaN seconds dropped every id it was given."""
    with pytest.raises(outbox.InvalidConfigError, match="must be positive and finite"):
        InMemoryReplayCache(ttl_s=ttl_s, max_entries=max_entries)


@pytest.mark.parametrize("tolerance_s", [0, -1, math.nan, math.inf])
def test_a_tolerance_that_would_turn_the_checks_off_is_refused(tolerance_s: float) -> None:
    """NaN passed `tolerance_s <= 0` and turned off the age and the replay checks: a request
    signed ten days before, or the same one replayed, was answered."""
    with pytest.raises(outbox.InvalidConfigError, match="tolerance_s must be positive and finite"):
        Verifier([NEW], tolerance_s=tolerance_s)
    with pytest.raises(outbox.InvalidConfigError, match="tolerance_s"):
        CheckHandler(lambda request: TransactionStatus.COMMIT, [NEW], tolerance_s=tolerance_s)


def test_errors_share_one_root() -> None:
    for name in checkback.__all__:
        obj = getattr(checkback, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, checkback.CheckbackError), name
    assert issubclass(ReplayedMessage, checkback.AuthenticationFailed)


def test_all_is_complete() -> None:
    public = {name for name in dir(checkback) if not name.startswith("_")}
    assert public == set(checkback.__all__)
