"""The probe server on IPv4 and IPv6 hosts (an IPv6 one failed to start)."""

from __future__ import annotations

import json
import socket
import threading
import urllib.error
import urllib.request
from typing import Any

import pytest

from relay.http import ProbeServer, gather
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
