import itertools
import random

import pytest

from relay.sharding import shard_of, shard_range, shard_ranges

LOWEST, HIGHEST = -(2**63), 2**63 - 1


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 64, 1024])
def test_ranges_cover_the_hash_space_without_gaps_or_overlaps(shards: int) -> None:
    ranges = [shard_range(s, shards) for s in range(shards)]
    assert ranges[0][0] == LOWEST
    assert ranges[-1][1] == HIGHEST
    for (_, hi), (lo, _) in itertools.pairwise(ranges):
        assert lo == hi + 1
    sizes = {hi - lo + 1 for lo, hi in ranges}
    assert max(sizes) - min(sizes) <= 1  # equal shares


@pytest.mark.parametrize("shards", [1, 3, 10, 1024])
def test_shard_of_agrees_with_the_ranges(shards: int) -> None:
    rng = random.Random(shards)
    edges = [b for s in range(shards) for b in shard_range(s, shards)]
    for key_hash in [*edges, 0, -1, *(rng.randint(LOWEST, HIGHEST) for _ in range(2000))]:
        lo, hi = shard_range(shard_of(key_hash, shards), shards)
        assert lo <= key_hash <= hi


def test_a_set_of_shards_becomes_two_arrays_and_bad_shards_are_refused() -> None:
    assert shard_ranges([0, 2], 4) == {
        "lo": [shard_range(0, 4)[0], shard_range(2, 4)[0]],
        "hi": [shard_range(0, 4)[1], shard_range(2, 4)[1]],
    }
    with pytest.raises(ValueError, match="shard 4 out of range for 4 shards"):
        shard_range(4, 4)
