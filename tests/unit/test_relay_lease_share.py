"""How many shards each live relay holds: the shares add up to the shards, none far apart."""

import pytest

from relay.leases import share


@pytest.mark.parametrize(
    ("shards", "members", "expected"),
    [
        (4, 3, [2, 1, 1]),  # ceil(4 / 3) each was 2, 2, 0
        (8, 7, [2, 1, 1, 1, 1, 1, 1]),  # and 2, 2, 2, 2, 0, 0, 0
        (16, 12, [2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]),
        (4, 4, [1, 1, 1, 1]),
        (2, 3, [1, 1, 0]),  # more relays than shards: the spares wait
        (1, 1, [1]),
    ],
)
def test_shares_add_up_to_the_shards(shards: int, members: int, expected: list[int]) -> None:
    ids = [f"relay-{n:02}" for n in range(members)]
    assert [share(shards, ids, me) for me in ids] == expected


def test_a_relay_not_yet_among_the_members_counts_itself() -> None:
    assert share(4, ["relay-b"], "relay-a") == 2
    assert share(4, ["relay-b"], "relay-c") == 2
