"""The public surface: every public name of a package is in its __all__, and nothing else."""

from __future__ import annotations

import importlib

import pytest


@pytest.mark.parametrize("package", ["outbox", "outbox.checkback"])
def test_all_is_complete(package: str) -> None:
    module = importlib.import_module(package)
    public = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and getattr(value, "__module__", package).startswith(package)
        and not isinstance(value, type(importlib))
    }
    assert set(module.__all__) >= public, f"missing from __all__: {public - set(module.__all__)}"
    assert all(hasattr(module, name) for name in module.__all__)
