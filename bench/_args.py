"""Argument checks the benchmarks share."""

from __future__ import annotations

from typing import TypeVar

N = TypeVar("N", int, float)


def numbers(text: str, kind: type[N], what: str) -> list[N]:
    """A comma-separated list of numbers above 0 (`kind`: int or float); a ValueError that says
    what is wrong, for argparse's error()."""
    try:
        values = [kind(n) for n in text.split(",")]
    except ValueError:
        wanted = "whole numbers" if kind is int else "numbers"
        raise ValueError(f"{what} must be {wanted} separated by commas, not {text!r}") from None
    if any(v <= 0 for v in values):
        raise ValueError(f"{what} must each be above 0, not {text!r}")
    return values
