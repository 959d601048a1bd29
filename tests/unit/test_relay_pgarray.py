"""Array literals for the relay's per-batch parameters (relay/pgarray.py)."""

import enum

import pytest

from relay import pgarray


def test_integers_keep_their_order_sign_and_nulls() -> None:
    assert pgarray.integers([3, -9_223_372_036_854_775_808, 0]) == "{3,-9223372036854775808,0}"
    assert pgarray.integers([1, None, 2]) == "{1,NULL,2}"
    assert pgarray.integers([]) == "{}"


class Kind(enum.IntEnum):
    A = 1


@pytest.mark.parametrize("value", [True, 1.0, "1", Kind.A])
def test_anything_but_an_int_is_refused(value: object) -> None:
    with pytest.raises(TypeError, match="not an integer"):
        pgarray.integers([1, value])  # type: ignore[list-item]


def test_words_are_each_quoted() -> None:
    assert pgarray.words(["committed", "rolled_back", "NULL", "123"]) == (
        '{"committed","rolled_back","NULL","123"}'
    )
    assert pgarray.words([]) == "{}"


@pytest.mark.parametrize("value", ["", "a,b", 'a"', "a b", "a\\", "{a}", "é"])
def test_a_word_that_would_need_escaping_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="not plain words"):
        pgarray.words(["committed", value])
