"""GRPO advantages and group statistics (host-side numpy; rows are host data).

A group is the set of rows whose rewards are compared with each other: by default (task, role) pooled
over the episodes of one task, so a role called several times per episode contributes several rows to
the same group and groups have variable size.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

GroupIds = Sequence[Hashable] | np.ndarray


def group_key(task_id: Hashable, role: str, call_index: int, *, by_index: bool) -> tuple:
    """The group key of one row.

    by_index=False pools every call of a role on a task into one group: (task_id, role).
    by_index=True keeps each call index apart: (task_id, role, call_index) (e.g. voters on math).
    """
    if by_index:
        return (task_id, role, int(call_index))
    return (task_id, role)


def _group_index(group_ids: GroupIds, n: int) -> tuple[np.ndarray, int]:
    """Dense group indices [R] in order of first appearance, and the number of groups."""
    if isinstance(group_ids, np.ndarray) and group_ids.ndim != 1:
        raise ValueError(f"group_ids must be 1-D, got shape {group_ids.shape}")
    ids = list(group_ids.tolist() if isinstance(group_ids, np.ndarray) else group_ids)
    if len(ids) != n:
        raise ValueError(f"group_ids has {len(ids)} entries but rewards has {n}; give one id per row")
    index: dict[Hashable, int] = {}
    try:
        dense = np.array([index.setdefault(g, len(index)) for g in ids], dtype=np.int64)
    except TypeError as e:  # e.g. a list as a key
        raise TypeError(f"group ids must be hashable (use tuples, not lists): {e}") from None
    return dense, len(index)


def _check_rewards(rewards: np.ndarray) -> np.ndarray:
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ValueError(f"rewards must be 1-D [R], got shape {r.shape}")
    if not np.all(np.isfinite(r)):
        raise ValueError("rewards contain NaN or inf; score every row with a finite reward")
    return r


def grpo_advantages(
    rewards: np.ndarray,
    group_ids: GroupIds,
    *,
    standardize: bool = True,
    eps: float = 1e-6,
) -> np.ndarray:
    """Per-row GRPO advantage [R] (float32).

    standardize=True: (r - mean_g) / (std_g + eps) with the unbiased (ddof=1) std of the row's group;
    standardize=False: r - mean_g. Groups of size 1 and groups whose rewards are all equal get 0.
    """
    r = _check_rewards(rewards)
    idx, n_groups = _group_index(group_ids, r.shape[0])
    adv = np.zeros_like(r)
    for g in range(n_groups):
        rows = np.flatnonzero(idx == g)
        vals = r[rows]
        # Size 1: no baseline. All equal: no signal (and avoids (tiny fp residue) / eps blow-ups).
        if rows.size < 2 or np.all(vals == vals[0]):
            continue
        centred = vals - vals.mean()
        if standardize:
            centred = centred / (vals.std(ddof=1) + eps)
        adv[rows] = centred
    return adv.astype(np.float32)


def group_outcomes(
    rewards: np.ndarray,
    group_ids: GroupIds,
    *,
    min_reward: float = 0.0,
    max_reward: float = 1.0,
) -> dict[str, float]:
    """How many groups were solved by none, all, or some of their rows.

    solve_none: every reward <= min_reward; solve_all: every reward >= max_reward; solve_partial: the
    rest. Returns num_groups, the counts (solve_none_count, ...) and the fractions of groups under the
    plain names (solve_none, solve_all, solve_partial), as the reference logs them.
    """
    if not max_reward > min_reward:
        raise ValueError(f"max_reward ({max_reward}) must exceed min_reward ({min_reward})")
    r = _check_rewards(rewards)
    idx, n_groups = _group_index(group_ids, r.shape[0])
    none = all_ = 0
    for g in range(n_groups):
        vals = r[idx == g]
        if np.all(vals <= min_reward):
            none += 1
        elif np.all(vals >= max_reward):
            all_ += 1
    partial = n_groups - none - all_
    denom = max(n_groups, 1)
    return {
        "num_groups": n_groups,
        "solve_none_count": none,
        "solve_all_count": all_,
        "solve_partial_count": partial,
        "solve_none": none / denom,
        "solve_all": all_ / denom,
        "solve_partial": partial / denom,
    }
