"""Optimiser: global-norm clipping then AdamW, applied independently per policy slot.

Trainable parameters carry a leading slot axis [S, ...]. per_slot(tx) vmaps a transformation over that
axis, so each slot has its own Adam moments, its own step count and its own gradient clipping, exactly
as if every slot had its own optimiser (the reference's per-role updates under Isolated-Policy).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

SCHEDULES = ("constant", "warmup_cosine")


def make_schedule(
    *,
    lr: float,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> optax.Schedule:
    """Learning rate by step (step 0 is the first update).

    constant: lr, after an optional linear warmup 0 -> lr over warmup_steps.
    warmup_cosine: linear 0 -> lr over warmup_steps, then cosine from lr down to lr * min_lr_ratio at
    total_steps (counted from step 0, warmup included), then flat.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if schedule == "constant":
        if warmup_steps == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)], [warmup_steps]
        )
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine needs total_steps > warmup_steps ({warmup_steps}), got {total_steps}"
        )
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup_steps,
        decay_steps=total_steps,
        end_value=lr * min_lr_ratio,
    )


def make_optimizer(
    *,
    lr: float,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    grad_clip: float | None = 1.0,
    schedule: str = "constant",
    warmup_steps: int = 0,
    total_steps: int | None = None,
    min_lr_ratio: float = 0.0,
) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) then AdamW on the schedule; grad_clip None or 0 disables clipping.

    For slot-stacked parameters wrap the result in per_slot.
    """
    sched = make_schedule(
        lr=lr, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps,
        min_lr_ratio=min_lr_ratio,
    )
    adamw = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if not grad_clip:
        return adamw
    if grad_clip < 0:
        raise ValueError(f"grad_clip must be positive (or None to disable), got {grad_clip}")
    return optax.chain(optax.clip_by_global_norm(grad_clip), adamw)


def _slot_count(tree) -> int:
    leaves = jax.tree_util.tree_leaves(tree)
    if not leaves:
        raise ValueError("empty parameter tree")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"every leaf needs the same leading slot axis; got leading sizes {sizes}")
    return sizes.pop()


def per_slot(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """Run tx independently on each slot of a tree whose leaves are [S, ...].

    init and update are jax.vmap'ed over the leading axis of params, grads and state, so every state
    leaf (moments and step count alike) also gets a leading S axis and global-norm clipping is per slot.
    """

    def init_fn(params):
        _slot_count(params)
        return jax.vmap(tx.init)(params)

    def update_fn(updates, state, params=None):
        _slot_count(updates)
        if params is None:
            return jax.vmap(lambda u, s: tx.update(u, s))(updates, state)
        return jax.vmap(tx.update)(updates, state, params)

    return optax.GradientTransformation(init_fn, update_fn)


def global_norm_per_slot(tree) -> jax.Array:
    """L2 norm of each slot over all leaves: leaves [S, ...] -> [S] float32."""
    _slot_count(tree)
    sq = [
        jnp.sum(jnp.square(x.astype(jnp.float32)).reshape(x.shape[0], -1), axis=1)
        for x in jax.tree_util.tree_leaves(tree)
    ]
    return jnp.sqrt(sum(sq))
