from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = [
    "tests.fixtures.services",
    "tests.fixtures.postgres",
    "tests.fixtures.pg_failover",
    "tests.fixtures.kafka",
    "tests.fixtures.spark",
    "tests.fixtures.relay",
    "tests.fixtures.helm",
    "tests.fixtures.kube",
    "tests.fixtures.images",
]

_LAYERS = {"unit", "integration", "spark", "deploy"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its layer from its folder, so `pytest -m unit` runs the fast subset.
    The tests on the API server and those of the alert rules run last: on a fresh machine they
    wait for the Go builds of the server and of promtool (started in the background by `make
    test`), and the chart's other tests need not wait with them."""
    last = {"kube", "promtool"}
    items.sort(key=lambda item: bool(last & set(getattr(item, "fixturenames", ()))))
    tests_dir = Path(__file__).parent
    for item in items:
        layer = item.path.relative_to(tests_dir).parts[0]
        if layer in _LAYERS:
            item.add_marker(getattr(pytest.mark, layer))
        if layer == "spark":
            # py4j leaves its gateway sockets to the garbage collector; not ours to fix.
            item.add_marker(
                pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
            )
