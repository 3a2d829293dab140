"""GRPO advantages and group outcomes against hand-worked numbers (statistics module, plain loops)."""
import math
import statistics

import numpy as np
import pytest

from marl_jax.rl.advantages import group_key, group_outcomes, grpo_advantages


def _rows():
    """A batch with groups of different sizes, as pooled (task, role) keys produce them.

    t1/gen: a pooled group of 5 calls (variable size); t1/agg: 3 rows; t2/gen: all equal; t2/agg: size 1;
    t3/gen: 2 rows. Rows of one group are interleaved with other groups on purpose.
    """
    rows = [
        (("t1", "gen"), 1.0),
        (("t1", "agg"), 0.0),
        (("t1", "gen"), 0.0),
        (("t2", "gen"), 1.0),
        (("t1", "gen"), 1.0),
        (("t2", "agg"), 1.0),
        (("t1", "agg"), 1.0),
        (("t2", "gen"), 1.0),
        (("t1", "gen"), 0.0),
        (("t3", "gen"), 0.0),
        (("t1", "gen"), 1.0),
        (("t1", "agg"), 1.0),
        (("t3", "gen"), 0.5),
        (("t2", "gen"), 1.0),
    ]
    keys = [k for k, _ in rows]
    rewards = np.array([r for _, r in rows])
    return keys, rewards


def test_standardized_by_hand():
    keys, rewards = _rows()
    adv = grpo_advantages(rewards, keys)
    assert adv.shape == (14,) and adv.dtype == np.float32
    # t1/gen: rewards 1,0,1,0,1 -> mean 0.6, unbiased var = (3*0.16 + 2*0.36)/4 = 0.3.
    s = math.sqrt(0.3) + 1e-6
    assert statistics.stdev([1, 0, 1, 0, 1]) == pytest.approx(math.sqrt(0.3))
    # t1/agg: 0,1,1 -> mean 2/3, unbiased var = (4/9 + 2/9)/2 = 1/3.
    s_agg = math.sqrt(1 / 3) + 1e-6
    # t3/gen: 0, 0.5 -> mean 0.25, unbiased std = sqrt(2 * 0.0625 / 1) = 0.353553...
    s3 = math.sqrt(0.125) + 1e-6
    expected = [
        0.4 / s, -2 / 3 / s_agg, -0.6 / s, 0.0, 0.4 / s, 0.0, 1 / 3 / s_agg,
        0.0, -0.6 / s, -0.25 / s3, 0.4 / s, 1 / 3 / s_agg, 0.25 / s3, 0.0,
    ]
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)


def test_unbiased_not_population_std():
    # Two rows 0 and 1: unbiased std = sqrt(0.5) -> +-0.7071; population std (0.5) would give +-1.
    adv = grpo_advantages(np.array([0.0, 1.0]), ["g", "g"])
    np.testing.assert_allclose(adv, [-0.5 / (math.sqrt(0.5) + 1e-6), 0.5 / (math.sqrt(0.5) + 1e-6)], rtol=1e-6)
    assert abs(adv[1]) < 0.75


def test_eps_enters_denominator():
    # Tiny spread: std = 1e-6*sqrt(0.5); eps dominates the denominator when large.
    r = np.array([0.0, 1e-6])
    std = 1e-6 * math.sqrt(0.5)
    for eps in (1e-6, 1.0):
        adv = grpo_advantages(r, [0, 0], eps=eps)
        np.testing.assert_allclose(adv, [-0.5e-6 / (std + eps), 0.5e-6 / (std + eps)], rtol=1e-5)


def test_not_standardized_by_hand():
    keys, rewards = _rows()
    adv = grpo_advantages(rewards, keys, standardize=False)
    expected = [0.4, -2 / 3, -0.6, 0.0, 0.4, 0.0, 1 / 3, 0.0, -0.6, -0.25, 0.4, 1 / 3, 0.25, 0.0]
    np.testing.assert_allclose(adv, expected, rtol=1e-6, atol=1e-7)


def test_size_one_and_all_equal_groups_are_zero():
    # 0.1 repeated: the float mean may differ from 0.1 by an ulp; the advantage must still be exactly 0.
    r = np.array([0.1] * 7 + [0.7])
    adv = grpo_advantages(r, [0] * 7 + [1])
    assert np.all(adv == 0.0)


def test_int_array_group_ids_match_hashable_ids():
    keys, rewards = _rows()
    uniq = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    ids = np.array([uniq[k] * 10 + 3 for k in keys])  # arbitrary ints, not dense
    np.testing.assert_array_equal(grpo_advantages(rewards, ids), grpo_advantages(rewards, keys))


def test_group_key_pooled_vs_by_index():
    # Voting on math: three voters keyed by index give 3 groups; pooled gives 1 group of all voters.
    pooled = [group_key("t", "voter", i, by_index=False) for i in range(3)]
    indexed = [group_key("t", "voter", i, by_index=True) for i in range(3)]
    assert pooled == [("t", "voter")] * 3
    assert indexed == [("t", "voter", 0), ("t", "voter", 1), ("t", "voter", 2)]
    # With rewards 1, 0, 0 for voters 0..2 over two episodes, keyed by index each group is 2 rows.
    rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    keys = indexed * 2
    adv = grpo_advantages(rewards, keys, standardize=False)
    np.testing.assert_allclose(adv, [0.0, -0.5, 0.0, 0.0, 0.5, 0.0])


def test_group_outcomes_counts():
    keys, rewards = _rows()
    out = group_outcomes(rewards, keys)
    # Groups: t1/gen partial, t1/agg partial, t2/gen all 1, t2/agg all 1 (size 1), t3/gen partial (0, 0.5).
    assert out["num_groups"] == 5
    assert (out["solve_none_count"], out["solve_all_count"], out["solve_partial_count"]) == (0, 2, 3)
    assert out["solve_all"] == pytest.approx(2 / 5) and out["solve_partial"] == pytest.approx(3 / 5)
    out2 = group_outcomes(np.array([0, 0, 1, 1, 0, 1, 0.0]), ["a", "a", "b", "b", "c", "c", "d"])
    assert (out2["solve_none_count"], out2["solve_all_count"], out2["solve_partial_count"]) == (2, 1, 1)
    assert out2["solve_none"] == pytest.approx(0.5)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="one id per row"):
        grpo_advantages(np.zeros(3), ["a", "b"])
    with pytest.raises(ValueError, match="finite"):
        grpo_advantages(np.array([0.0, np.nan]), ["a", "a"])
    with pytest.raises(TypeError, match="hashable"):
        grpo_advantages(np.zeros(2), [["a"], ["a"]])
