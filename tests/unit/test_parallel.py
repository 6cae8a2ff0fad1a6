"""The split of micro-batches over ranks and the rank-count check (learner/parallel.py)."""

from __future__ import annotations

import pytest

from learner.parallel import check_ranks, share


@pytest.mark.parametrize("n,size", [(0, 2), (1, 2), (3, 2), (4, 2), (7, 3), (2, 4)])
def test_every_unit_goes_to_one_rank_and_counts_are_equal(n: int, size: int) -> None:
    units = list(range(n))
    shares = [share(units, r, size) for r in range(size)]
    assert len({len(s) for s in shares}) == 1  # as many calls on every rank (ZeRO-2/3 collectives)
    assert len(shares[0]) == -(-n // size)
    assert sorted(u for s in shares for u in s if u is not None) == units  # each once
    assert all(s.count(None) <= 1 for s in shares)  # padding: at most one zero-weighted call per rank


def test_rank_check_names_the_settings() -> None:
    check_ranks(rows=16, minibatches=4, size=4)
    with pytest.raises(ValueError, match="5 learner ranks but 4 samples per mini-batch.*minibatches 4"):
        check_ranks(rows=16, minibatches=4, size=5)
