"""Levers on the update: per-role changes to the exact per-role gradients before the optimiser.

The update (marl_jax.rl.update) measures one exact gradient per role, g_k (the sum of its diagnostic
groups; under Shared-Policy the roles of a slot add up to the slot's gradient). `apply` rewrites them
in this order and sums them back per slot, before clipping and AdamW:

1. gradient-coherence damping (lambda = `damping`, EMA window W = `damping_window`):
       c_k = cos(g_k, m_k)                       (0 while m_k or g_k is zero)
       g_k <- (1 - lambda * max(0, c_k)) * g_k
       m_k <- beta * m_k + (1 - beta) * g_k_raw,   beta = 1 - 1 / W
   m_k, the EMA of role k's past (undamped) gradients, lives in TrainState.grad_ema and is
   checkpointed. No bias correction: a cosine does not see the EMA's scale.
2. fan-out scaling, for a role that runs k parallel copies per episode (voters, workers):
       g_k <- k^-p * g_k,   p = 1 ("inverse"), 1/2 ("inverse_sqrt"), 0 ("none")
3. gradient-mass balancing (a slot shared by several roles): each role's norm share
   |g_k| / sum_j |g_j| (over the slot's roles with a non-zero gradient) is set to a target t_k while
   the slot's total mass sum_j |g_j| is kept:
       g_k <- t_k * (sum_j |g_j|) / |g_k| * g_k
   targets: "equal" (1/n each), "weights" (proportional to balance_weights[k]) or "capped" (each
   role's measured share, cut at balance_cap; the excess goes to the uncapped roles in proportion
   to their shares, water-filling until none is above the cap).

The per-role KL anchor needs no lever here: grpo.kl_coef.<role> is each role's coefficient against
the frozen base model (LoRA off / the initial full weights), with grpo.kl_estimator k1 (log ratio),
k3 or its other name "low_var" (exp(ref - logp) - (ref - logp) - 1, unbiased and non-negative).

`apply` also returns the shares before and after (projection share <g_k, g_slot> / |g_slot|^2 and
norm share), the damping factors and cosines, and each role's overall scale |g_k'| / |g_k|.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

FANOUT = {"none": 0.0, "inverse_sqrt": 0.5, "inverse": 1.0}
BALANCE = ("none", "equal", "weights", "capped")
KL_ESTIMATOR_NAMES = {"k1": "k1", "k3": "k3", "low_var": "k3"}


@dataclasses.dataclass(frozen=True)
class LeverConfig:
    damping: float = 0.0  # lambda; 0 turns damping off
    damping_window: int = 64  # EMA window W (beta = 1 - 1/W)
    fanout: str = "none"
    balance: str = "none"
    balance_weights: tuple[float, ...] = ()  # one per role, for balance="weights"
    balance_cap: float = 1.0  # for balance="capped"
    copies: tuple[int, ...] = ()  # parallel copies of each role (1 if empty)

    def __post_init__(self):
        if not 0.0 <= self.damping <= 1.0:
            raise ValueError(f"levers.damping (lambda) must be in [0, 1], got {self.damping}")
        if self.damping_window < 1:
            raise ValueError(f"levers.damping_window must be >= 1, got {self.damping_window}")
        if self.fanout not in FANOUT:
            raise ValueError(f"levers.fanout must be one of {list(FANOUT)}, got {self.fanout!r}")
        if self.balance not in BALANCE:
            raise ValueError(f"levers.balance must be one of {list(BALANCE)}, got {self.balance!r}")
        if self.balance == "weights" and (not self.balance_weights or min(self.balance_weights) < 0
                                          or sum(self.balance_weights) <= 0):
            raise ValueError("levers.balance=weights needs levers.balance_weights.<role> >= 0, not all 0")
        if self.balance == "capped" and not 0.0 < self.balance_cap <= 1.0:
            raise ValueError(f"levers.balance_cap must be in (0, 1], got {self.balance_cap}")

    @property
    def damps(self) -> bool:
        return self.damping > 0.0

    @property
    def active(self) -> bool:
        return self.damps or self.balance != "none" or (
            FANOUT[self.fanout] > 0 and any(k > 1 for k in self.copies))


def kl_estimator(name: str) -> str:
    """The loss's estimator for a config name ("low_var" is k3)."""
    if name not in KL_ESTIMATOR_NAMES:
        raise ValueError(f"grpo.kl_estimator must be one of {list(KL_ESTIMATOR_NAMES)}, got {name!r}")
    return KL_ESTIMATOR_NAMES[name]


def init_ema(trainable, num_roles: int):
    """Zero EMA per role, shaped like one slot of the slot-stacked trainable tree: [K, ...]."""
    return jax.tree_util.tree_map(lambda x: jnp.zeros((num_roles,) + x.shape[1:], jnp.float32), trainable)


def _dots(a, b):
    """[K] inner products of two [K, ...] trees."""
    return sum(jnp.sum((x.astype(jnp.float32) * y.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _scale(tree, s):
    return jax.tree_util.tree_map(lambda x: x * s.reshape((-1,) + (1,) * (x.ndim - 1)).astype(x.dtype), tree)


def damping_factors(role_g, ema, lam: float):
    """(1 - lambda * max(0, cos(g_k, m_k))) and the cosines, [K] each."""
    gg, mm, gm = _dots(role_g, role_g), _dots(ema, ema), _dots(role_g, ema)
    denom = jnp.sqrt(gg * mm)
    cos = jnp.where(denom > 0, gm / jnp.where(denom > 0, denom, 1.0), 0.0)
    return 1.0 - lam * jnp.maximum(cos, 0.0), cos


def ema_update(ema, role_g, window: int):
    beta = 1.0 - 1.0 / window
    return jax.tree_util.tree_map(lambda m, g: beta * m + (1.0 - beta) * g.astype(jnp.float32), ema, role_g)


def fanout_factors(copies, power: float, num_roles: int):
    k = jnp.asarray(tuple(copies) or (1,) * num_roles, jnp.float32)
    return k ** (-power)


def balance_targets(norms, k_slot, num_slots: int, mode: str, weights=None, cap: float = 1.0):
    """Target norm share of each role within its slot ([K], summing to 1 over the slot's roles with a
    non-zero gradient; 0 for the others)."""
    K = norms.shape[0]
    on = norms > 0
    per_slot = lambda v: jax.ops.segment_sum(v, k_slot, num_segments=num_slots)[k_slot]
    if mode == "equal":
        raw = on.astype(jnp.float32)
    elif mode == "weights":
        raw = jnp.where(on, jnp.asarray(weights, jnp.float32), 0.0)
    elif mode == "capped":
        share = norms / jnp.maximum(per_slot(norms), 1e-30)
        t = share
        for _ in range(K):  # water-filling: cap, hand the excess to the uncapped roles, repeat
            capped = t >= cap
            t = jnp.where(capped, cap, t)
            free = jnp.where(capped | ~on, 0.0, t)
            excess = 1.0 - per_slot(jnp.where(on, t, 0.0))
            t = jnp.where(capped | ~on, t, t + excess * free / jnp.maximum(per_slot(free), 1e-30))
        # a slot whose roles cannot all stay under the cap (n * cap < 1) gets equal shares
        n = per_slot(on.astype(jnp.float32))
        raw = jnp.where(n * cap < 1.0, on.astype(jnp.float32), jnp.where(on, t, 0.0))
    else:
        raise ValueError(f"balance mode must be one of {BALANCE[1:]}, got {mode!r}")
    return raw / jnp.maximum(per_slot(raw), 1e-30)


def shares(role_g, k_slot, num_slots: int):
    """Projection shares <g_k, g_slot(k)> / |g_slot(k)|^2 and norm shares |g_k| / sum_slot |g_j|, [K] each."""
    slot_g = jax.tree_util.tree_map(lambda x: jax.ops.segment_sum(x, k_slot, num_segments=num_slots), role_g)
    of_role = jax.tree_util.tree_map(lambda x: x[k_slot], slot_g)
    proj = _dots(role_g, of_role) / jnp.maximum(_dots(of_role, of_role), 1e-30)
    norms = jnp.sqrt(jnp.maximum(_dots(role_g, role_g), 0.0))
    total = jax.ops.segment_sum(norms, k_slot, num_segments=num_slots)[k_slot]
    return proj, norms / jnp.maximum(total, 1e-30), norms


def apply(lv: LeverConfig, role_g, ema, k_slot, num_slots: int):
    """Levers on the per-role gradients role_g ([K, ...] tree). Returns (slot gradients [S, ...],
    new EMA (None without damping), metrics of [K] arrays)."""
    if role_g is None:
        raise ValueError("levers need the exact per-role gradients: set grpo.diagnostics=True and "
                         "grpo.diagnostics_every=1")
    K = k_slot.shape[0]
    proj0, nshare0, norms0 = shares(role_g, k_slot, num_slots)
    g = role_g
    m = {"share_before": proj0, "norm_share_before": nshare0}
    new_ema = ema
    if lv.damps:
        if ema is None:
            raise ValueError("levers.damping needs TrainState.grad_ema (levers.init_ema)")
        factor, cos = damping_factors(g, ema, lv.damping)
        new_ema = ema_update(ema, role_g, lv.damping_window)
        g = _scale(g, factor)
        m.update(damping_factor=factor, ema_cos=cos)
    if FANOUT[lv.fanout] > 0:
        g = _scale(g, fanout_factors(lv.copies, FANOUT[lv.fanout], K))
    if lv.balance != "none":
        norms = jnp.sqrt(jnp.maximum(_dots(g, g), 0.0))
        target = balance_targets(norms, k_slot, num_slots, lv.balance, lv.balance_weights or None, lv.balance_cap)
        mass = jax.ops.segment_sum(norms, k_slot, num_segments=num_slots)[k_slot]
        g = _scale(g, jnp.where(norms > 0, target * mass / jnp.where(norms > 0, norms, 1.0), 0.0))
        m["balance_target"] = target
    proj1, nshare1, norms1 = shares(g, k_slot, num_slots)
    m.update(share_after=proj1, norm_share_after=nshare1,
             scale=jnp.where(norms0 > 0, norms1 / jnp.where(norms0 > 0, norms0, 1.0), 1.0))
    grads = jax.tree_util.tree_map(lambda x: jax.ops.segment_sum(x, k_slot, num_segments=num_slots), g)
    return grads, new_ema, m


def records(m: dict[str, Any], roles) -> dict[str, float]:
    """Flatten apply()'s metrics into named scalars: lever/<role>/<name>."""
    import numpy as np

    out = {}
    for name, v in m.items():
        v = np.asarray(jax.device_get(v))
        for k, r in enumerate(roles):
            out[f"lever/{r}/{name}"] = float(v[k])
    return out
