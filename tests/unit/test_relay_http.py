"""The probe server on IPv4 and IPv6 hosts (an IPv6 one failed to start)."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from relay.http import ProbeServer


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
