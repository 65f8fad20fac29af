"""Splitting items over processes."""

from comlrl_trl.batching import even_shard


def test_even_shard_gives_every_process_as_many_items():
    assert even_shard(3, 0, 2) == ([0, 2], 2)
    assert even_shard(3, 1, 2) == ([1, 2], 1)  # item 2 repeated, its results dropped
    assert even_shard(4, 1, 2) == ([1, 3], 2)
    assert even_shard(5, 0, 1) == ([0, 1, 2, 3, 4], 5)
