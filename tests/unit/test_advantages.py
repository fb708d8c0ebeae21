from __future__ import annotations

import math

import pytest

from coordinator.core.advantages import group_advantages


def test_single_group_is_normalised_with_population_std() -> None:
    # mean 2.5, population std sqrt(1.25)
    out = group_advantages([1.0, 2.0, 3.0, 4.0], 4)
    std = math.sqrt(1.25)
    assert out == pytest.approx([(r - 2.5) / (std + 1e-6) for r in (1, 2, 3, 4)])
    assert sum(out) == pytest.approx(0.0, abs=1e-9)


def test_binary_group_gives_plus_minus_one() -> None:
    out = group_advantages([1.0, 0.0, 1.0, 0.0], 4)
    assert out == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_groups_are_normalised_independently() -> None:
    out = group_advantages([0.0, 1.0, 10.0, 30.0], 2)
    assert out == pytest.approx([-1.0, 1.0, -1.0, 1.0], abs=1e-5)


def test_zero_variance_group_gives_exact_zeros() -> None:
    out = group_advantages([1.0, 1.0, 1.0, 0.0, 1.0, 0.5], 3)
    assert out[:3] == [0.0, 0.0, 0.0]
    assert out[3:] != [0.0, 0.0, 0.0]
    assert group_advantages([0.0] * 8, 4) == [0.0] * 8


def test_group_size_one_is_all_zero() -> None:
    assert group_advantages([0.3, 0.9], 1) == [0.0, 0.0]


def test_empty_rewards_give_empty_advantages() -> None:
    assert group_advantages([], 4) == []


def test_output_length_and_order_match_input() -> None:
    rewards = [0.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    out = group_advantages(rewards, 3)
    assert len(out) == 6
    assert out[1] > 0 > out[0] and out[0] == pytest.approx(out[2])
    assert out[5] > 0 > out[3] and out[4] == pytest.approx(out[5])


@pytest.mark.parametrize(("n", "group_size"), [(5, 2), (3, 4), (4, 0), (4, -2), (7, 3)])
def test_bad_group_sizes_raise(n: int, group_size: int) -> None:
    with pytest.raises(ValueError):
        group_advantages([1.0] * n, group_size)
