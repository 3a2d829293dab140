"""Terminal cliff: offline definition on hand-worked curves, and the online monitor against it."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from marl_jax.train.cliff import DEFAULTS, CliffMonitor, detect_cliff, trailing_mean

STEPS11 = list(range(0, 110, 10))
CLEAN = [0.30, 0.40, 0.50, 0.60, 0.62, 0.61, 0.35, 0.30, 0.28, 0.30, 0.29]


def test_clean_cliff_known_step():
    # Peak 0.62 at step 40; step 60 falls to 0.35 <= 0.62 - 0.15 and nothing after reaches 0.545.
    rep = detect_cliff(STEPS11, CLEAN)
    assert rep.detected and rep.step == 60
    assert rep.peak_step == 40 and rep.peak_value == pytest.approx(0.62)
    assert rep.final_value == pytest.approx(0.29) and rep.drop == pytest.approx(0.33)
    assert rep.params == {"drop": 0.15, "recover_frac": 0.5, "window": 1, "min_points": 2}
    # a larger threshold: 0.62 - 0.35 = 0.27 >= 0.25 still; 0.30 is the first point with 0.32 >= 0.3
    assert detect_cliff(STEPS11, CLEAN, drop=0.25).step == 60
    assert detect_cliff(STEPS11, CLEAN, drop=0.3).step == 70
    assert not detect_cliff(STEPS11, CLEAN, drop=0.4).detected


def test_dip_that_recovers_is_no_cliff():
    vals = [0.30, 0.50, 0.60, 0.40, 0.38, 0.58, 0.60, 0.62]
    rep = detect_cliff(range(0, 80, 10), vals)
    assert not rep.detected and rep.step is None
    assert rep.peak_step == 70 and rep.peak_value == pytest.approx(0.62) and rep.drop == pytest.approx(0.0)


def test_later_cliff_after_recovered_dip():
    # 60 is a dip (recovers to 0.58 >= 0.525 at 70); the terminal fall starts at 90.
    vals = [0.3, 0.5, 0.55, 0.6, 0.6, 0.6, 0.40, 0.58, 0.59, 0.30, 0.32, 0.31]
    rep = detect_cliff(range(0, 120, 10), vals)
    assert rep.detected and rep.step == 90 and rep.peak_step == 30


def test_monotone_rise_is_no_cliff():
    vals = np.linspace(0.2, 0.7, 30)
    rep = detect_cliff(range(30), vals)
    assert not rep.detected and rep.peak_step == 29 and rep.drop == pytest.approx(0.0)


def test_noisy_plateau_is_no_cliff():
    # noise spans at most 0.12 < drop, so no point can fall 0.15 below any earlier one
    vals = 0.5 + np.random.default_rng(0).uniform(-0.06, 0.06, 60)
    assert not detect_cliff(range(0, 600, 10), vals).detected
    assert not detect_cliff(range(0, 600, 10), vals, window=3).detected


def test_cliff_at_the_end_edges():
    steps = [0, 10, 20, 30, 40]
    last_only = [0.3, 0.5, 0.6, 0.6, 0.3]
    assert not detect_cliff(steps, last_only).detected  # one low evaluation does not confirm it
    rep = detect_cliff(steps, last_only, min_points=1)
    assert rep.detected and rep.step == 40 and rep.peak_step == 20
    rep = detect_cliff(steps + [50], last_only + [0.3])
    assert rep.detected and rep.step == 40
    # the base model as the peak: a run that only falls
    rep = detect_cliff([0, 10, 20], [0.6, 0.3, 0.3])
    assert rep.detected and rep.step == 10 and rep.peak_step == 0


def test_thresholds_are_inclusive_up_to_rounding():
    assert detect_cliff([0, 10, 20], [0.60, 0.45, 0.45]).step == 10  # exactly 0.15
    assert not detect_cliff([0, 10, 20], [0.60, 0.451, 0.451]).detected
    # coming back exactly to the recovery line (0.6 - 0.075) counts as recovered
    vals = [0.6, 0.4, 0.525, 0.4]
    assert not detect_cliff(range(4), vals).detected
    assert detect_cliff(range(4), [0.6, 0.4, 0.524, 0.4]).step == 1
    assert detect_cliff(range(4), vals, min_points=1).step == 3
    # recover_frac=0: only a return to the old peak counts as recovery
    assert detect_cliff(range(4), [0.6, 0.4, 0.59, 0.4], recover_frac=0.0).step == 1
    assert not detect_cliff(range(4), [0.6, 0.4, 0.59, 0.4]).detected
    # recover_frac=1: any climb back above the fall threshold (0.45) counts as recovery
    assert not detect_cliff(range(4), [0.6, 0.4, 0.46, 0.4], recover_frac=1.0).detected
    assert detect_cliff(range(4), [0.6, 0.4, 0.46, 0.4]).step == 1


def test_smoothing_window():
    vals = [0.6, 0.6, 0.6, 0.4, 0.4, 0.4, 0.4]
    assert detect_cliff(range(0, 70, 10), vals).step == 30
    # window 3: smoothed 0.6, 0.6, 0.6, 0.5333, 0.4667, 0.4, 0.4 -> first <= 0.45 is index 5
    rep = detect_cliff(range(0, 70, 10), vals, window=3)
    assert rep.step == 50 and rep.peak_value == pytest.approx(0.6) and rep.final_value == pytest.approx(0.4)
    assert rep.params["window"] == 3
    np.testing.assert_allclose(trailing_mean(vals, 3), [0.6, 0.6, 0.6, 1.6 / 3, 1.4 / 3, 0.4, 0.4])
    np.testing.assert_allclose(trailing_mean([1.0, np.nan, 3.0], 2), [1.0, 1.0, 3.0])


def test_missing_values_and_errors():
    vals = list(CLEAN)
    vals.insert(3, float("nan"))
    steps = STEPS11[:3] + [25] + STEPS11[3:]
    assert detect_cliff(steps, vals).step == 60
    empty = detect_cliff([], [])
    assert not empty.detected and empty.peak_value is None and empty.params == dict(DEFAULTS)
    with pytest.raises(ValueError, match="strictly increasing"):
        detect_cliff([0, 10, 10], [0.1, 0.2, 0.3])
    with pytest.raises(ValueError, match="equal length"):
        detect_cliff([0, 10], [0.1])
    with pytest.raises(ValueError, match="drop"):
        detect_cliff([0], [0.1], drop=0)


def _feed(mon, steps, vals):
    return [mon.update(s, v) for s, v in zip(steps, vals)]


def test_monitor_fires_at_expected_step():
    mon = CliffMonitor(patience=3)
    fired = _feed(mon, STEPS11, CLEAN)
    # the fall starts at 60 (index 6); three low evaluations: 60, 70, 80
    assert fired == [False] * 8 + [True] * 3
    assert mon.cliff_step == 60 and mon.peak_step == 40 and mon.peak_value == pytest.approx(0.62)
    mon1 = CliffMonitor(patience=1)
    assert _feed(mon1, STEPS11, CLEAN).index(True) == 6


def test_monitor_ignores_recovered_dip_but_not_a_long_one():
    vals = [0.30, 0.50, 0.60, 0.40, 0.38, 0.58, 0.60, 0.62]
    assert not any(_feed(CliffMonitor(patience=3), range(8), vals))
    # a dip of 2 evaluations trips patience=2: the documented false alarm of stopping early
    mon = CliffMonitor(patience=2)
    assert _feed(mon, range(8), vals).index(True) == 4 and mon.cliff_step == 3
    # after a recovery the peak keeps rising and the streak restarts from zero
    vals2 = [0.6, 0.4, 0.6, 0.7, 0.5, 0.5, 0.5]
    mon = CliffMonitor(patience=3)
    assert _feed(mon, range(7), vals2).index(True) == 6 and mon.cliff_step == 4 and mon.peak_step == 3


def test_monitor_is_an_online_bound_of_the_offline_definition():
    rng = np.random.default_rng(1)
    checked = 0
    for trial in range(300):
        n = int(rng.integers(3, 30))
        vals = np.clip(0.4 + np.cumsum(rng.normal(0, 0.08, n)), 0, 1)
        window = int(rng.integers(1, 3))
        patience = int(rng.integers(1, 4))
        rep = detect_cliff(range(n), vals, window=window, min_points=patience)
        mon = CliffMonitor(patience=patience, window=window)
        fired = _feed(mon, range(n), vals)
        if rep.detected:
            checked += 1
            assert True in fired and fired.index(True) <= rep.step + patience - 1
            assert mon.cliff_step <= rep.step
        if not any(fired):
            assert not rep.detected
    assert checked > 20  # the random walks do produce cliffs


def test_monitor_state_round_trip():
    half = 5
    full = CliffMonitor(patience=3, window=2)
    expect = _feed(full, STEPS11, CLEAN)
    a = CliffMonitor(patience=3, window=2)
    got = _feed(a, STEPS11[:half], CLEAN[:half])
    b = CliffMonitor(patience=3, window=2)
    b.load_state(json.loads(json.dumps(a.state())))
    got += _feed(b, STEPS11[half:], CLEAN[half:])
    assert got == expect and b.cliff_step == full.cliff_step
    with pytest.raises(ValueError, match="saved with"):
        CliffMonitor(patience=2).load_state(a.state())
    assert not CliffMonitor().update(0, math.nan)
    m = CliffMonitor()
    m.update(10, 0.5)
    with pytest.raises(ValueError, match="increase"):
        m.update(10, 0.5)
