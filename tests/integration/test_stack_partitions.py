"""`scripts/services partition|heal`: a port left unreachable, as a failed host is, then healed."""

from __future__ import annotations

import socket

import pytest

from scripts import services as local_services


def test_a_partition_drops_a_ports_packets_until_healed(can_partition: None) -> None:
    with socket.socket() as server:
        server.bind((local_services.HOST, 0))
        server.listen()
        port = int(server.getsockname()[1])
        assert local_services.partition(port)
        try:
            # no reset, no answer: the connection attempt times out, as with a dead host
            with pytest.raises(TimeoutError):
                socket.create_connection((local_services.HOST, port), timeout=1).close()
        finally:
            local_services.heal()  # every rule of this stack's, whatever its port
        socket.create_connection((local_services.HOST, port), timeout=1).close()
