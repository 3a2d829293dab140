"""Per-slot optimiser against independent optax optimisers and hand-computed AdamW / schedule values."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from marl_jax.rl.optim import global_norm_per_slot, make_optimizer, make_schedule, per_slot


def _tree(rng, scale=(1.0, 1.0)):
    """A 2-slot tree; slot s is multiplied by scale[s]."""
    t = {"a": rng.normal(size=(2, 3)), "b": {"c": rng.normal(size=(2, 2, 2))}}
    s = np.array(scale)
    return {
        "a": jnp.array(t["a"] * s[:, None], jnp.float32),
        "b": {"c": jnp.array(t["b"]["c"] * s[:, None, None], jnp.float32)},
    }


def _slot(tree, s):
    return jax.tree_util.tree_map(lambda x: x[s], tree)


def _norm_np(tree, s):
    return math.sqrt(sum(float(np.sum(np.asarray(x[s], np.float64) ** 2)) for x in jax.tree_util.tree_leaves(tree)))


def test_global_norm_per_slot():
    tree = _tree(np.random.default_rng(0), scale=(3.0, 0.1))
    got = np.asarray(global_norm_per_slot(tree))
    np.testing.assert_allclose(got, [_norm_np(tree, 0), _norm_np(tree, 1)], rtol=1e-6)


def test_per_slot_equals_independent_optimizers():
    rng = np.random.default_rng(1)
    params = _tree(rng)
    kw = dict(lr=1e-2, weight_decay=0.01, grad_clip=1.0, eps=1e-3)
    tx = per_slot(make_optimizer(**kw))
    state = tx.init(params)
    singles = [make_optimizer(**kw) for _ in range(2)]
    p_single = [_slot(params, s) for s in range(2)]
    s_single = [singles[s].init(p_single[s]) for s in range(2)]
    # Slot 0's grad norm swings across the clip (5x, 0.3x, 8x); slot 1 stays under it, so clipping and
    # Adam's moments interact differently per slot.
    scales = [(5.0, 0.2), (0.3, 0.1), (8.0, 0.4)]
    clipped_any = False
    for sc in scales:
        grads = _tree(rng, sc)
        n = np.asarray(global_norm_per_slot(grads))
        clipped_any |= bool(n[0] > 1.0 and n[1] < 1.0)
        upd, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, upd)
        for s in range(2):
            u, s_single[s] = singles[s].update(_slot(grads, s), s_single[s], p_single[s])
            p_single[s] = optax.apply_updates(p_single[s], u)
            for got, want in zip(jax.tree_util.tree_leaves(_slot(upd, s)), jax.tree_util.tree_leaves(u)):
                np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-9)
    assert clipped_any
    for s in range(2):
        for got, want in zip(jax.tree_util.tree_leaves(_slot(params, s)), jax.tree_util.tree_leaves(p_single[s])):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-8)
    # The step count is per slot too.
    counts = [x for x in jax.tree_util.tree_leaves(state) if jnp.issubdtype(x.dtype, jnp.integer)]
    assert counts and all(c.shape == (2,) and list(np.asarray(c)) == [3, 3] for c in counts)


def test_per_slot_clipping_by_hand_and_differs_from_global():
    rng = np.random.default_rng(2)
    grads = _tree(rng, (4.0, 0.05))
    n0, n1 = _norm_np(grads, 0), _norm_np(grads, 1)
    assert n0 > 1.0 > n1
    clip = per_slot(optax.clip_by_global_norm(1.0))
    out, _ = clip.update(grads, clip.init(grads))
    for x, g in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(grads)):
        g = np.asarray(g)
        np.testing.assert_allclose(np.asarray(x[0]), g[0] / n0, rtol=1e-5)  # slot 0 scaled to norm 1
        np.testing.assert_allclose(np.asarray(x[1]), g[1], rtol=1e-6)  # slot 1 untouched
    # Clipping the stacked tree as one would also shrink slot 1.
    glob, _ = optax.clip_by_global_norm(1.0).update(grads, None)
    assert not np.allclose(np.asarray(glob["a"][1]), np.asarray(grads["a"][1]))


def test_adamw_two_steps_by_hand():
    """Two AdamW steps with clipping written out in numpy (eps large so clipping is visible)."""
    rng = np.random.default_rng(3)
    lr, wd, b1, b2, eps = 0.1, 0.05, 0.9, 0.99, 0.5
    params = _tree(rng)
    g1, g2 = _tree(rng, (6.0, 0.3)), _tree(rng, (0.5, 3.0))
    tx = per_slot(make_optimizer(lr=lr, weight_decay=wd, b1=b1, b2=b2, eps=eps, grad_clip=1.0))
    state = tx.init(params)
    u1, state = tx.update(g1, state, params)
    p1 = optax.apply_updates(params, u1)
    u2, state = tx.update(g2, state, p1)
    for s in range(2):
        c1 = min(1.0, 1.0 / _norm_np(g1, s))
        c2 = min(1.0, 1.0 / _norm_np(g2, s))
        for leaf in range(2):
            get = lambda t: np.asarray(jax.tree_util.tree_leaves(t)[leaf][s], np.float64)
            p0, ga, gb = get(params), get(g1) * c1, get(g2) * c2
            m1, v1 = (1 - b1) * ga, (1 - b2) * ga**2
            step1 = -lr * ((m1 / (1 - b1)) / (np.sqrt(v1 / (1 - b2)) + eps) + wd * p0)
            np.testing.assert_allclose(get(u1), step1, rtol=1e-5, atol=1e-7)
            pm = p0 + step1
            m2, v2 = b1 * m1 + (1 - b1) * gb, b2 * v1 + (1 - b2) * gb**2
            step2 = -lr * ((m2 / (1 - b1**2)) / (np.sqrt(v2 / (1 - b2**2)) + eps) + wd * pm)
            np.testing.assert_allclose(get(u2), step2, rtol=1e-5, atol=1e-7)


def test_warmup_cosine_values_by_hand():
    lr, w, total, mr = 1e-3, 4, 12, 0.1
    sched = make_schedule(lr=lr, schedule="warmup_cosine", warmup_steps=w, total_steps=total, min_lr_ratio=mr)

    def hand(step):
        if step < w:
            return lr * step / w
        prog = min((step - w) / (total - w), 1.0)
        return lr * (mr + (1 - mr) * 0.5 * (1 + math.cos(math.pi * prog)))

    assert hand(8) == pytest.approx(5.5e-4) and hand(12) == pytest.approx(1e-4)
    for step in (0, 1, 2, 4, 6, 8, 11, 12, 20):
        assert float(sched(step)) == pytest.approx(hand(step), rel=1e-5, abs=1e-12), step


def test_optimizer_follows_schedule_step_by_step():
    # b1 = b2 = 0 and no weight decay: each AdamW update is -lr(t) * g / (|g| + eps) = -lr(t) * sign(g).
    lr, w, total = 0.01, 2, 6
    tx = per_slot(make_optimizer(lr=lr, weight_decay=0.0, b1=0.0, b2=0.0, eps=1e-12, grad_clip=None,
                                 schedule="warmup_cosine", warmup_steps=w, total_steps=total))
    params = {"w": jnp.zeros((2, 3))}
    grads = {"w": jnp.array([[1.0, -2.0, 3.0], [-0.5, 0.5, 4.0]])}
    state = tx.init(params)
    for step in range(8):
        want = lr * step / w if step < w else lr * 0.5 * (1 + math.cos(math.pi * min((step - w) / (total - w), 1.0)))
        upd, state = tx.update(grads, state, params)
        np.testing.assert_allclose(np.asarray(upd["w"]), -want * np.sign(np.asarray(grads["w"])), rtol=1e-5, atol=1e-9)


def test_constant_schedule_with_warmup():
    sched = make_schedule(lr=2e-5, schedule="constant", warmup_steps=5)
    assert [float(sched(s)) for s in (0, 1, 5, 100)] == pytest.approx([0.0, 4e-6, 2e-5, 2e-5])
    assert float(make_schedule(lr=2e-5)(0)) == pytest.approx(2e-5)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="total_steps"):
        make_optimizer(lr=1e-3, schedule="warmup_cosine", warmup_steps=10)
    with pytest.raises(ValueError, match="schedule"):
        make_optimizer(lr=1e-3, schedule="linear")
    with pytest.raises(ValueError, match="leading slot axis"):
        per_slot(make_optimizer(lr=1e-3)).init({"a": jnp.zeros((2, 3)), "b": jnp.zeros((3,))})
