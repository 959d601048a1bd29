"""The probe server on IPv4 and IPv6 hosts (an IPv6 one failed to start)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from relay.http import InFlight, ProbeServer, gather
from tests.fixtures.http import get


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize(
    ("host", "url_host"),
    [
        ("127.0.0.1", "127.0.0.1"),
        pytest.param(
            "::1",
            "[::1]",
            marks=pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here"),
        ),
    ],
)
def test_probes_answer_on_the_host_given(host: str, url_host: str) -> None:
    server = ProbeServer(host, 0, alive={"relay": lambda: True}, ready={})
    server.start()
    try:
        with urllib.request.urlopen(f"http://{url_host}:{server.port}/healthz", timeout=5) as r:
            assert (r.status, json.loads(r.read())) == (200, {"relay": True})
    finally:
        server.stop()


def test_head_answers_as_get_without_a_body() -> None:
    """A load balancer's HEAD check got 501 Unsupported method."""
    server = ProbeServer(
        "127.0.0.1", 0, alive={"relay": lambda: True}, ready={"relay": lambda: {"ready": False}}
    )
    server.start()
    try:
        base = f"http://127.0.0.1:{server.port}"
        head = urllib.request.Request(f"{base}/healthz", method="HEAD")
        with urllib.request.urlopen(head, timeout=5) as r:
            assert (r.status, r.read()) == (200, b"")
            assert int(r.headers["Content-Length"]) > 0  # what a GET would carry
        ready = urllib.request.Request(f"{base}/readyz", method="HEAD")
        with pytest.raises(urllib.error.HTTPError) as not_ready:
            urllib.request.urlopen(ready, timeout=5)
        assert not_ready.value.code == 503
        not_ready.value.close()
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:  # GET keeps its body
            assert json.loads(r.read()) == {"relay": True}
    finally:
        server.stop()


def test_the_components_readiness_checks_run_at_once_not_one_after_another() -> None:
    """In an outage each check waits a connect timeout or two: one after another /readyz took
    20-30 s, past a kubelet's probe timeout. Here the first check can only end once the second
    has begun, which one after another it never would."""
    second_began = threading.Event()

    def first() -> dict[str, Any]:
        return {"ready": second_began.wait(30)}

    def second() -> dict[str, Any]:
        second_began.set()
        return {"ready": True}

    server = ProbeServer("127.0.0.1", 0, alive={}, ready={"relay": first, "checker": second})
    server.start()
    try:
        code, body = get(server.port, "/readyz")
        assert (code, json.loads(body)) == (
            200,
            {"relay": {"ready": True}, "checker": {"ready": True}},  # in the components' order
        )
    finally:
        server.stop()


def test_gather_raises_a_checks_failure_after_all_have_ended() -> None:
    failed, ended = threading.Event(), threading.Event()

    def fails() -> bool:
        failed.set()
        raise RuntimeError("probe broke")

    def slow() -> bool:  # ends only after the other failed
        failed.wait(30)
        ended.set()
        return True

    with pytest.raises(RuntimeError, match="probe broke"):
        gather({"fails": fails, "slow": slow})
    assert ended.is_set()
    assert gather({"one": lambda: 1}) == {"one": 1}
    assert gather({}) == {}


def test_gather_within_a_deadline_gives_a_late_check_its_stand_in() -> None:
    """The database's own waits (a connect timeout, 10 s by default) ran past the kubelet's
    probe timeout: a check not ended within the deadline is answered for, the others kept."""
    release = threading.Event()
    try:
        started = time.monotonic()
        answer = gather(
            {"database": lambda: release.wait(30), "broker": lambda: True},
            0.3,
            late=lambda name: f"{name} late",
        )
        took = time.monotonic() - started
        assert answer == {"database": "database late", "broker": True}
        assert list(answer) == ["database", "broker"]  # in the checks' order
        assert took < 10
        with pytest.raises(TimeoutError, match=re.escape("not ended within 0.2 s: database")):
            gather({"database": lambda: release.wait(30), "broker": lambda: True}, 0.2)
        # alone, it still runs on a thread of its own: the deadline holds for one check too
        assert gather({"database": lambda: release.wait(30)}, 0.2, late=lambda _: False) == {
            "database": False
        }
    finally:
        release.set()


def test_gather_within_a_deadline_raises_the_failure_of_a_check_that_ended() -> None:
    release = threading.Event()

    def fails() -> bool:
        raise RuntimeError("probe broke")

    try:
        with pytest.raises(RuntimeError, match="probe broke"):
            gather({"late": lambda: release.wait(30), "fails": fails}, 0.3, late=lambda _: False)
    finally:
        release.set()


def test_a_check_still_running_from_an_earlier_probe_is_waited_for_not_started_again() -> None:
    """Each probe past its deadline left its check's thread behind: a client probing often a
    check that hangs (a JVM that stalls) grew the threads without bound."""
    release = threading.Event()
    calls: list[int] = []

    def stuck() -> bool:
        calls.append(1)
        return release.wait(30)

    in_flight = InFlight()
    try:
        for _ in range(3):
            assert gather({"db": stuck}, 0.1, lambda _: "late", in_flight) == {"db": "late"}
        assert len(calls) == 1
        release.set()
        assert gather({"db": stuck}, 10, lambda _: "late", in_flight) == {"db": True}
        assert len(calls) in (1, 2)  # the one still running, or one started after it ended
        release.clear()
        calls.clear()
        # ended: the next probe checks anew
        assert gather({"db": lambda: calls.append(1) or True}, 10, None, in_flight) == {"db": True}
        assert calls == [1]
    finally:
        release.set()


def test_readyz_answers_within_its_deadline_with_the_part_that_did_not() -> None:
    """Past the kubelet's timeout the kubelet said only that the probe timed out."""
    release = threading.Event()
    server = ProbeServer(
        "127.0.0.1",
        0,
        alive={},
        ready={"relay": lambda: {"ready": release.wait(30)}, "checker": lambda: {"ready": True}},
        ready_within_s=0.5,
    )
    server.start()
    try:
        code, body = get(server.port, "/readyz")
        assert (code, json.loads(body)) == (
            503,
            {
                "relay": {"ready": False, "late": "no answer within 0.5 s"},
                "checker": {"ready": True},
            },
        )
    finally:
        release.set()
        server.stop()


def _connected(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port), timeout=10)
    conn.settimeout(10)
    return conn


def _cut(conn: socket.socket, within_s: float = 10) -> bool:
    """True if the server closed `conn` (with no answer) within `within_s`."""
    conn.settimeout(within_s)
    try:
        return conn.recv(1024) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def test_a_request_head_that_does_not_come_within_the_deadline_is_cut_off() -> None:
    """A client that connected and sent nothing, or a header byte at a time just inside each
    read's timeout, held a thread for ever."""
    server = ProbeServer("127.0.0.1", 0, alive={"relay": lambda: True}, ready={}, head_deadline_s=1)
    server.start()
    try:
        idle, trickling = _connected(server.port), _connected(server.port)
        trickling.sendall(b"GET /healthz HTTP/1.1\r\n")
        for byte in b"X-Slow: 1234567890\r\n":  # 0.1 s apart: each read well within 1 s
            try:
                trickling.sendall(bytes([byte]))
            except OSError:  # cut off meanwhile
                break
            time.sleep(0.1)
        assert _cut(trickling, within_s=5)
        assert _cut(idle, within_s=5)
        idle.close()
        trickling.close()
        assert get(server.port, "/healthz") == (200, b'{"relay": true}')
    finally:
        server.stop()


def test_at_the_connection_cap_the_one_waiting_longest_for_its_request_makes_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("relay.http.IDLE_AFTER_S", 0.0)  # idle as soon as they come
    server = ProbeServer("127.0.0.1", 0, alive={"relay": lambda: True}, ready={}, max_connections=4)
    server.start()
    idle = [_connected(server.port) for _ in range(20)]
    try:
        # the probe is taken after all of them: 17 make room, the 3 newest stay open
        assert get(server.port, "/healthz") == (200, b'{"relay": true}')
        assert [_cut(conn) for conn in idle[:17]] == [True] * 17
        assert [_cut(conn, within_s=0.2) for conn in idle[17:]] == [False] * 3
    finally:
        for conn in idle:
            conn.close()
        server.stop()


def test_a_connection_that_just_came_is_not_cut_to_make_room() -> None:
    """A kubelet's probe connects and sends at once: cut before its thread read it, the probe
    failed under a flood of new connections. Over the cap, the newest is refused instead."""
    server = ProbeServer("127.0.0.1", 0, alive={"relay": lambda: True}, ready={}, max_connections=2)
    server.start()
    first, second = _connected(server.port), _connected(server.port)
    try:
        refused = _connected(server.port)  # both others came well within IDLE_AFTER_S
        assert _cut(refused)
        refused.close()
        assert [_cut(conn, within_s=0.2) for conn in (first, second)] == [False, False]
    finally:
        first.close()
        second.close()
        server.stop()


def test_a_connection_cut_to_make_room_is_not_answered_once_its_input_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cut while its headers were still to come, the end of its input ended them, and the
    request was answered, uncounted: a /readyz (a database probe and a broker round trip)
    holding a thread for every new connection past the cap."""
    monkeypatch.setattr("relay.http.IDLE_AFTER_S", 0.0)
    readiness_checks: list[float] = []

    def ready() -> dict[str, Any]:
        readiness_checks.append(time.monotonic())
        return {"ready": True}

    server = ProbeServer("127.0.0.1", 0, alive={"relay": lambda: True}, ready={"relay": ready},
                         max_connections=1)  # fmt: skip
    server.start()
    cut = _connected(server.port)
    try:
        cut.sendall(b"GET /readyz HTTP/1.0\r\n")  # its headers still to come
        time.sleep(0.3)  # its thread reads the request line, then waits for the headers
        assert get(server.port, "/healthz") == (200, b'{"relay": true}')  # makes room
        assert _cut(cut)
        until = time.monotonic() + 1  # its thread reads the end of its input, and ends
        while not readiness_checks and time.monotonic() < until:
            time.sleep(0.05)
        assert readiness_checks == []
    finally:
        cut.close()
        server.stop()


def test_at_the_connection_cap_with_every_request_being_answered_a_new_one_is_refused(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, answering = threading.Event(), threading.Semaphore(0)

    def slow() -> dict[str, Any]:  # an outage's readiness check, waiting a connect timeout
        return {"ready": release.wait(30)}

    def gather_noted(*args: Any) -> Any:  # both requests wait for the one check still running
        answering.release()
        return gather(*args)

    monkeypatch.setattr("relay.http.gather", gather_noted)

    server = ProbeServer(
        "127.0.0.1", 0, alive={}, ready={"relay": slow}, max_connections=2, ready_within_s=60
    )
    server.start()
    waiting = [threading.Thread(target=get, args=(server.port, "/readyz")) for _ in range(2)]
    try:
        for thread in waiting:
            thread.start()
        assert answering.acquire(timeout=10)
        assert answering.acquire(timeout=10)
        refused = _connected(server.port)
        refused.sendall(b"GET /healthz HTTP/1.1\r\n\r\n")
        assert _cut(refused)
        refused.close()
        assert "all 2 connections are being answered" in caplog.text
    finally:
        release.set()
        for thread in waiting:
            thread.join(10)
        server.stop()
    assert get(server.port, "/healthz")[0] == 0  # stopped
