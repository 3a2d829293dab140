"""Terminal accuracy cliff: a defined, detectable collapse of a validation curve that never recovers.

Definition (offline, on a whole curve). Given evaluations ``(t_i, v_i)``, i = 0..n-1, with strictly
increasing steps (non-finite values are dropped as missing evaluations):

1. Smooth with a trailing mean over the last ``window`` evaluations:
   ``s_i = mean(v_j for j in [max(0, i - window + 1), i])`` (``window=1``: the raw curve).
2. Running peak before i: ``P_i = max(s_0, ..., s_{i-1})`` (the base model at step 0 counts).
3. Index i is a *cliff* when
   (a) it falls by at least ``drop`` (absolute, in the units of the values) from that peak:
       ``s_i <= P_i - drop``;
   (b) it never recovers: every later point stays below the recovery line,
       ``s_j < P_i - recover_frac * drop`` for all j > i;
   (comparisons allow 1e-9 for float rounding, so 0.60 -> 0.45 is a drop of 0.15);
   (c) it is confirmed: at least ``min_points`` evaluations lie at or after i (``n - i >= min_points``),
       so a single low final evaluation is not enough by default.
4. The cliff step is ``t_i`` for the first such i; ``peak_step`` is where ``P_i`` was first reached.

Defaults: ``drop=0.15`` (15 accuracy points: about 7 standard errors of pass@1 on 500 validation
tasks, 2.5 on 64), ``recover_frac=0.5`` (climbing back to within half the drop of the peak counts as
recovered; 0 would demand a return to the peak itself, 1 any climb back above the fall threshold),
``window=1``, ``min_points=2``. Every report carries the parameters it used.

Online approximation (``CliffMonitor``): the future is unknown, so (b) becomes "has not recovered for
``patience`` evaluations". The monitor keeps the same smoothed running peak; a *streak* starts at an
evaluation with ``s <= peak - drop`` and continues while ``s < peak - recover_frac * drop``; the monitor
fires when a streak reaches ``patience`` evaluations. Guarantee: if the offline definition finds a
cliff at index i with at least ``patience`` evaluations from i on, the monitor has fired by index
``i + patience - 1``. It can also fire on a long dip that later recovers (which offline is no cliff);
that is the price of stopping early, after which the trainer restores the best checkpoint.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

__all__ = ["CliffReport", "detect_cliff", "CliffMonitor", "trailing_mean", "DEFAULTS"]

DEFAULTS: dict[str, float | int] = {"drop": 0.15, "recover_frac": 0.5, "window": 1, "min_points": 2}
_EPS = 1e-9  # so that e.g. 0.60 -> 0.45 counts as a drop of 0.15 despite float rounding


def _fell(s: float, peak: float, drop: float) -> bool:
    return s <= peak - drop + _EPS


def _below_recovery(s: float, peak: float, drop: float, recover_frac: float) -> bool:
    return s < peak - recover_frac * drop - _EPS


@dataclasses.dataclass(frozen=True)
class CliffReport:
    """Result of :func:`detect_cliff`.

    detected: whether the curve has a terminal cliff.
    step: the cliff step (None if not detected).
    peak_step / peak_value: the running peak the cliff fell from; without a cliff, the curve's maximum
      (first step reaching it). Values are of the smoothed curve.
    final_value: the last smoothed value.
    drop: ``peak_value - final_value`` (how far the curve ended below that peak; also reported
      without a cliff, as a continuous measure).
    params: the parameters used (drop, recover_frac, window, min_points).
    """

    detected: bool
    step: int | None
    peak_step: int | None
    peak_value: float | None
    final_value: float | None
    drop: float | None
    params: dict[str, Any]


def trailing_mean(values: Sequence[float], window: int) -> np.ndarray:
    """Mean of each value and the ``window - 1`` before it (fewer at the start); NaNs are skipped."""
    if int(window) < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    v = np.asarray(values, dtype=np.float64)
    out = np.full(v.shape, np.nan)
    for i in range(len(v)):
        seg = v[max(0, i - int(window) + 1): i + 1]
        seg = seg[np.isfinite(seg)]
        if seg.size:
            out[i] = seg.mean()
    return out


def _clean(steps: Sequence[int], values: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    s = np.asarray(list(steps))
    v = np.asarray(list(values), dtype=np.float64)
    if s.shape != v.shape or s.ndim != 1:
        raise ValueError(f"steps and values must be 1-D and of equal length, got {s.shape} and {v.shape}")
    keep = np.isfinite(v)
    s, v = s[keep], v[keep]
    if s.size > 1 and np.any(np.diff(s) <= 0):
        raise ValueError("steps must be strictly increasing (sort the curve and remove duplicate steps)")
    return s.astype(np.int64), v


def _check_params(drop: float, recover_frac: float, window: int, min_points: int) -> dict[str, Any]:
    if not drop > 0:
        raise ValueError(f"drop must be > 0, got {drop}")
    if not 0 <= recover_frac <= 1:
        raise ValueError(f"recover_frac must be in [0, 1], got {recover_frac}")
    if int(window) < 1 or int(min_points) < 1:
        raise ValueError(f"window and min_points must be >= 1, got {window} and {min_points}")
    return {"drop": float(drop), "recover_frac": float(recover_frac), "window": int(window),
            "min_points": int(min_points)}


def detect_cliff(steps: Sequence[int], values: Sequence[float], *, drop: float = DEFAULTS["drop"],
                 recover_frac: float = DEFAULTS["recover_frac"], window: int = DEFAULTS["window"],
                 min_points: int = DEFAULTS["min_points"]) -> CliffReport:
    """Finds the terminal cliff of a validation curve, as defined in the module docstring."""
    params = _check_params(drop, recover_frac, window, min_points)
    t, v = _clean(steps, values)
    n = len(v)
    if n == 0:
        return CliffReport(False, None, None, None, None, None, params)
    s = trailing_mean(v, params["window"])
    # suffix_max[i] = max(s[i:]); the "never recovers" test for index i uses suffix_max[i + 1]
    suffix_max = np.maximum.accumulate(s[::-1])[::-1]
    peak_idx = 0
    for i in range(1, n):
        if s[i - 1] > s[peak_idx]:
            peak_idx = i - 1  # running peak over s[0..i-1], first index reaching it
        peak = s[peak_idx]
        later_max = suffix_max[i + 1] if i + 1 < n else -math.inf
        if (_fell(s[i], peak, params["drop"])
                and _below_recovery(later_max, peak, params["drop"], params["recover_frac"])
                and n - i >= params["min_points"]):
            return CliffReport(True, int(t[i]), int(t[peak_idx]), float(peak), float(s[-1]),
                               float(peak - s[-1]), params)
    gi = int(np.argmax(s))
    return CliffReport(False, None, int(t[gi]), float(s[gi]), float(s[-1]), float(s[gi] - s[-1]), params)


class CliffMonitor:
    """Online cliff detector for early stopping (see the module docstring for its relation to
    :func:`detect_cliff`).

    ``update(step, value)`` returns True from the evaluation at which the monitor fires onwards.
    After it fires, ``cliff_step`` is the first step of the firing streak and ``peak_step`` /
    ``peak_value`` the peak it fell from.
    """

    def __init__(self, drop: float = DEFAULTS["drop"], patience: int = 3,
                 recover_frac: float = DEFAULTS["recover_frac"], window: int = DEFAULTS["window"]):
        if int(patience) < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.params = _check_params(drop, recover_frac, window, 1)
        del self.params["min_points"]
        self.params["patience"] = int(patience)
        self._raw: list[float] = []
        self._last_step: int | None = None
        self.peak_step: int | None = None
        self.peak_value: float | None = None
        self.streak = 0
        self._streak_start: int | None = None
        self.fired = False
        self.cliff_step: int | None = None

    def update(self, step: int, value: float) -> bool:
        """Feeds one evaluation; non-finite values are ignored. Returns whether the monitor has fired."""
        if self.fired:
            return True
        if not math.isfinite(float(value)):
            return False
        step = int(step)
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"steps must increase: got {step} after {self._last_step}")
        self._last_step = step
        w = self.params["window"]
        self._raw = (self._raw + [float(value)])[-w:]  # only the smoothing window is needed
        s = float(np.mean(self._raw))
        p = self.params
        if self.peak_value is not None:
            if self.streak == 0 and _fell(s, self.peak_value, p["drop"]):
                self.streak, self._streak_start = 1, step
            elif self.streak > 0 and _below_recovery(s, self.peak_value, p["drop"], p["recover_frac"]):
                self.streak += 1
            elif self.streak > 0:  # recovered; the point may also be a new peak (below)
                self.streak, self._streak_start = 0, None
            if self.streak >= p["patience"]:
                self.fired, self.cliff_step = True, self._streak_start
                return True
        if self.streak == 0 and (self.peak_value is None or s > self.peak_value):
            self.peak_value, self.peak_step = s, step
        return False

    def state(self) -> dict[str, Any]:
        """JSON-able monitor state, so it survives a checkpoint/resume."""
        return {"raw": list(self._raw), "last_step": self._last_step, "peak_step": self.peak_step,
                "peak_value": self.peak_value, "streak": self.streak, "streak_start": self._streak_start,
                "fired": self.fired, "cliff_step": self.cliff_step, "params": dict(self.params)}

    def load_state(self, state: dict[str, Any]) -> None:
        if state.get("params") != self.params:
            raise ValueError(f"monitor state was saved with {state.get('params')}, this monitor has {self.params}")
        self._raw = [float(x) for x in state["raw"]][-self.params["window"]:]
        self._last_step = state["last_step"]
        self.peak_step, self.peak_value = state["peak_step"], state["peak_value"]
        self.streak, self._streak_start = int(state["streak"]), state["streak_start"]
        self.fired, self.cliff_step = bool(state["fired"]), state["cliff_step"]
