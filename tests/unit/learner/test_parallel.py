"""How a mini-batch's rows are dealt to ranks, the equal call counts, and the rank-count check
(learner/parallel.py)."""

from __future__ import annotations

import pytest
import torch

from learner.parallel import check_ranks, padded, split_rows


@pytest.mark.parametrize("n,size", [(1, 2), (3, 2), (8, 2), (7, 3), (2, 4), (19, 2)])
def test_rows_are_dealt_once_each_and_balanced_by_tokens(n: int, size: int) -> None:
    g = torch.Generator().manual_seed(n)
    lengths = torch.randint(5, 200, (n + 3,), generator=g)
    idx = torch.randperm(n + 3, generator=g)[:n]  # a mini-batch: some rows of the batch, shuffled
    shares = split_rows(idx, lengths, size)
    assert len(shares) == size
    assert sorted(torch.cat(shares).tolist()) == sorted(idx.tolist())  # every row once
    loads = [int(lengths[s].sum()) for s in shares]
    # longest-first to the least loaded: no rank exceeds another by more than its longest row
    assert max(loads) - min(loads) <= int(lengths[idx].max())
    assert [s.tolist() for s in split_rows(idx, lengths, size)] == [s.tolist() for s in shares]  # deterministic


def test_ragged_rows_give_ranks_different_token_counts() -> None:
    lengths = torch.tensor([100, 10, 10, 10, 10, 10])
    a, b = split_rows(torch.arange(6), lengths, 2)
    assert a.tolist() == [0] and b.tolist() == [1, 2, 3, 4, 5]  # 100 tokens each: one long row against five


def test_call_counts_are_padded_to_the_busiest_rank() -> None:
    units = [["a", "b", "c"], ["d"], []]
    assert [padded(units, r) for r in range(3)] == [["a", "b", "c"], ["d", None, None], [None, None, None]]


def test_rank_check_names_the_settings() -> None:
    check_ranks(rows=16, minibatches=4, size=4)
    with pytest.raises(ValueError, match="5 learner ranks but 4 samples per mini-batch.*minibatches 4"):
        check_ranks(rows=16, minibatches=4, size=5)
