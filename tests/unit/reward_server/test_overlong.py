"""Overlong shaping (DAPO Eq. 13) at and around its boundaries."""

import pytest

from reward_server.overlong import overlong_penalty

L_MAX, L_CACHE = 20480, 4096  # the paper's values


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (0, 0.0),
        (16383, 0.0),
        (16384, 0.0),  # L_max - L_cache: last length without penalty
        (16385, -1 / 4096),  # first penalised length
        (18432, -0.5),  # half-way through the buffer
        (20479, -4095 / 4096),
        (20480, -1.0),  # L_max itself: the linear part ends at -1
        (20481, -1.0),  # beyond L_max
        (10**9, -1.0),
    ],
)
def test_paper_values(length: int, expected: float) -> None:
    assert overlong_penalty(length, L_MAX, L_CACHE) == pytest.approx(expected, abs=1e-12)


def test_factor_scales_and_caps() -> None:
    assert overlong_penalty(18432, L_MAX, L_CACHE, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(30000, L_MAX, L_CACHE, factor=0.5) == -0.5


def test_monotone_non_increasing() -> None:
    values = [overlong_penalty(n, 100, 20) for n in range(0, 130)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[80] == 0.0 and values[81] < 0 and values[100] == -1.0


def test_cache_equal_to_max_len_penalises_from_the_first_token() -> None:
    assert overlong_penalty(0, 64, 64) == 0.0
    assert overlong_penalty(32, 64, 64) == -0.5


@pytest.mark.parametrize(("length", "max_len", "cache_len"), [(-1, 10, 5), (1, 10, 0), (1, 10, 11)])
def test_bad_arguments(length: int, max_len: int, cache_len: int) -> None:
    with pytest.raises(ValueError):
        overlong_penalty(length, max_len, cache_len)
