"""Levers (marl_jax.rl.levers) change the applied update exactly as their formulas say.

The applied gradient is read back from an SGD step (new = old - lr * g) on a tiny random model and
compared with per-row gradients computed directly from the unpadded rows (test_update's reference)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_update import LR, _ref_grad, _rows, _setup, CFG

from marl_jax.rl import levers as LV
from marl_jax.rl import optim
from marl_jax.rl.batch import make_batch, make_groups
from marl_jax.rl.update import UpdateConfig, init_state, make_train_step

flat = lambda t: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree_util.tree_leaves(t)])


def _lever_step(base, spec, tr, rows, advs, role_to_slot, roles, levers=None, copies=None, ema=None):
    groups = make_groups(roles, role_to_slot, copies)
    batch = make_batch(rows, np.asarray(advs, np.float32), role_to_slot=role_to_slot, num_slots=spec.num_slots,
                       groups=groups, micro_batch=4)
    tx = optim.per_slot(optax.sgd(LR))
    step = make_train_step(CFG, spec, UpdateConfig(micro_batch=4), tx, num_groups=len(groups.names),
                           group_slot=groups.slot, group_role=[roles.index(r) for r in groups.role],
                           num_roles=len(roles), role_slot=[role_to_slot[r] for r in roles], levers=levers)
    state = init_state(jax.tree_util.tree_map(jnp.array, tr), tx)
    if ema is not None:
        state = state._replace(grad_ema=ema)
    new, m = step(state, base, jax.tree_util.tree_map(jnp.asarray, batch))
    return jax.tree_util.tree_map(lambda a, b: (b - a) / LR, new.trainable, tr), m, new


def _role_grads(base, spec, tr, rows, advs, roles, slot=0):
    """Each role's exact gradient of its slot's mean-over-rows loss (rows of other roles add 0)."""
    on_slot = list(range(len(rows)))
    return {r: flat(_ref_grad(base, spec, tr, slot, rows, advs, {i for i in on_slot if rows[i].role == r}))
            for r in roles}


def _slot0(g):
    return flat(jax.tree_util.tree_map(lambda x: x[0], g))


def test_damping_with_lambda_zero_is_a_no_op_and_off_levers_change_nothing():
    rng = np.random.RandomState(0)
    base, spec, tr = _setup(1)
    rows = _rows(rng, [("gen", 5, 1), ("judge", 3, 1)])
    advs = list(rng.randn(len(rows)))
    ref, _, s0 = _lever_step(base, spec, tr, rows, advs, {"gen": 0, "judge": 0}, ["gen", "judge"])
    for lv in (LV.LeverConfig(damping=0.0, damping_window=8), LV.LeverConfig(fanout="inverse", copies=(1, 1))):
        assert not lv.active
        g, m, s = _lever_step(base, spec, tr, rows, advs, {"gen": 0, "judge": 0}, ["gen", "judge"], levers=lv)
        np.testing.assert_array_equal(_slot0(g), _slot0(ref))
        assert "levers" not in m and s.grad_ema is None


def test_damping_scales_each_role_by_one_minus_lambda_positive_cosine_and_updates_the_ema():
    rng = np.random.RandomState(1)
    base, spec, tr = _setup(1)
    roles = ["gen", "judge"]
    rows = _rows(rng, [("gen", 5, 1), ("judge", 3, 1)])
    advs = list(rng.randn(len(rows)))
    per_role = _role_grads(base, spec, tr, rows, advs, roles)
    lam, window = 0.3, 4
    # EMA of gen: its own gradient plus an orthogonal part (cos = 1/sqrt(2)); of judge: minus its gradient
    # (cos = -1, no damping).
    one = jax.tree_util.tree_map(lambda x: x[0], tr)
    unflat = lambda v: jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(one),
        np.split(v.astype(np.float32), np.cumsum([x.size for x in jax.tree_util.tree_leaves(one)])[:-1]))
    shaped = lambda v: jax.tree_util.tree_map(lambda a, b: np.reshape(b, a.shape), one, unflat(v))
    g0 = per_role["gen"]
    ortho = rng.randn(g0.size)
    ortho -= (ortho @ g0) / (g0 @ g0) * g0
    ortho *= np.linalg.norm(g0) / np.linalg.norm(ortho)
    m_gen, m_judge = g0 + ortho, -2.0 * per_role["judge"]
    ema = jax.tree_util.tree_map(lambda a, b: jnp.stack([jnp.asarray(a), jnp.asarray(b)]), shaped(m_gen),
                                 shaped(m_judge))
    lv = LV.LeverConfig(damping=lam, damping_window=window)
    g, m, new = _lever_step(base, spec, tr, rows, advs, {"gen": 0, "judge": 0}, roles, levers=lv, ema=ema)
    want = (1 - lam / np.sqrt(2)) * per_role["gen"] + 1.0 * per_role["judge"]
    np.testing.assert_allclose(_slot0(g), want, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(m["levers"]["damping_factor"]), [1 - lam / np.sqrt(2), 1.0], rtol=1e-4)
    np.testing.assert_allclose(np.asarray(m["levers"]["ema_cos"]), [1 / np.sqrt(2), -1.0], rtol=1e-4)
    beta = 1 - 1 / window
    for k, (mk, gk) in enumerate([(m_gen, per_role["gen"]), (m_judge, per_role["judge"])]):
        got = flat(jax.tree_util.tree_map(lambda x: x[k], new.grad_ema))
        np.testing.assert_allclose(got, beta * mk + (1 - beta) * gk, rtol=2e-4, atol=1e-7)


def test_first_damped_step_is_undamped_and_starts_the_ema():
    rng = np.random.RandomState(2)
    base, spec, tr = _setup(2)
    roles = ["gen", "judge"]
    rows = _rows(rng, [("gen", 4, 1), ("judge", 4, 1)])
    advs = list(rng.randn(len(rows)))
    ref, _, _ = _lever_step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, roles)
    lv = LV.LeverConfig(damping=0.3, damping_window=10)
    g, m, new = _lever_step(base, spec, tr, rows, advs, {"gen": 0, "judge": 1}, roles, levers=lv,
                            ema=LV.init_ema(tr, 2))
    np.testing.assert_allclose(flat(g), flat(ref), rtol=1e-6, atol=1e-9)  # zero EMA: cos 0, factor 1
    for k in range(2):  # Isolated: role k's EMA is 0.1 x its slot's gradient
        np.testing.assert_allclose(flat(jax.tree_util.tree_map(lambda x: x[k], new.grad_ema)),
                                   0.1 * flat(jax.tree_util.tree_map(lambda x: x[k], ref)), rtol=1e-5, atol=2e-8)


@pytest.mark.parametrize("mode,weights,want", [("equal", (), (0.5, 0.5)), ("weights", (3.0, 1.0), (0.75, 0.25))])
def test_balancing_gives_the_target_norm_shares_and_keeps_the_mass(mode, weights, want):
    rng = np.random.RandomState(5)
    base, spec, tr = _setup(1)
    roles = ["gen", "judge"]
    rows = _rows(rng, [("gen", 7, 1), ("judge", 4, 1)])
    advs = list(rng.randn(len(rows)))
    per_role = _role_grads(base, spec, tr, rows, advs, roles)
    n = {r: np.linalg.norm(v) for r, v in per_role.items()}
    assert min(n.values()) > 0 and max(n.values()) > 1.5 * min(n.values())  # unequal shares to start from
    mass = n["gen"] + n["judge"]
    lv = LV.LeverConfig(balance=mode, balance_weights=weights)
    g, m, _ = _lever_step(base, spec, tr, rows, advs, {"gen": 0, "judge": 0}, roles, levers=lv)
    hand = sum(t * mass / n[r] * per_role[r] for r, t in zip(roles, want))
    np.testing.assert_allclose(_slot0(g), hand, rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(np.asarray(m["levers"]["norm_share_after"]), want, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(m["levers"]["norm_share_before"]),
                               [n["gen"] / mass, n["judge"] / mass], rtol=1e-4)
    # measured after the fact: each role's part of the applied step has the target share of the mass
    parts = [t * mass / n[r] * per_role[r] for r, t in zip(roles, want)]
    norms = np.array([np.linalg.norm(p) for p in parts])
    np.testing.assert_allclose(norms / norms.sum(), want, rtol=1e-6)
    # projection shares before/after against the hand-computed gradients
    full = per_role["gen"] + per_role["judge"]
    np.testing.assert_allclose(np.asarray(m["levers"]["share_before"]),
                               [per_role[r] @ full / (full @ full) for r in roles], rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(m["levers"]["share_after"]),
                               [p @ hand / (hand @ hand) for p in parts], rtol=1e-3, atol=1e-6)


def test_capped_targets_water_fill():
    k_slot = jnp.asarray([0, 0, 0, 1], jnp.int32)
    t = LV.balance_targets(jnp.asarray([8.0, 1.0, 1.0, 5.0]), k_slot, 2, "capped", cap=0.5)
    np.testing.assert_allclose(np.asarray(t), [0.5, 0.25, 0.25, 1.0], rtol=1e-6)
    t = LV.balance_targets(jnp.asarray([6.0, 3.0, 1.0, 0.0]), k_slot, 2, "capped", cap=0.4)
    # 0.6 -> 0.4; the 0.2 goes 3:1 to the others: 0.3 + 0.15 = 0.45 -> 0.4, its 0.05 to the last: 0.2
    np.testing.assert_allclose(np.asarray(t), [0.4, 0.4, 0.2, 0.0], rtol=1e-5, atol=1e-7)
    t = LV.balance_targets(jnp.asarray([6.0, 3.0, 1.0, 2.0]), k_slot, 2, "capped", cap=0.2)  # 3 x 0.2 < 1
    np.testing.assert_allclose(np.asarray(t), [1 / 3, 1 / 3, 1 / 3, 1.0], rtol=1e-6)


def test_fanout_inverse_on_identical_copies_gives_the_single_copy_step():
    rng = np.random.RandomState(4)
    base, spec, tr = _setup(1)
    roles = ["voter", "agg"]
    voter = _rows(rng, [("voter", 4, 1)])
    agg = _rows(rng, [("agg", 4, 1)])
    k = 3
    copies = [dataclasses.replace(r, call_index=c) for r in voter for c in range(k)]
    rows, advs = copies + agg, [1.0, -0.5, 0.7, -1.2] * 0 + list(np.repeat(rng.randn(4), k)) + list(rng.randn(4))
    lv = LV.LeverConfig(fanout="inverse", copies=(k, 1))
    g, m, _ = _lever_step(base, spec, tr, rows, advs, {"voter": 0, "agg": 0}, roles, levers=lv,
                          copies={"voter": k})
    # hand: (sum over one copy's voter rows + sum over agg rows) / the batch's rows (4k + 4)
    single = [i for i in range(0, 4 * k, k)] + list(range(4 * k, 4 * k + 4))
    want = flat(_ref_grad(base, spec, tr, 0, rows, advs, set(single)))
    np.testing.assert_allclose(_slot0(g), want, rtol=2e-4, atol=1e-7)
    # the voter's share after fan-out is the share it has in a batch with one copy
    one_rows = [rows[i] for i in single]
    one_advs = [advs[i] for i in single]
    _, m1, _ = _lever_step(base, spec, tr, one_rows, one_advs, {"voter": 0, "agg": 0}, roles)
    np.testing.assert_allclose(np.asarray(m["levers"]["share_after"]), np.asarray(m1["role_grad_share"]),
                               rtol=1e-3, atol=1e-6)
    np.testing.assert_allclose(np.asarray(m["levers"]["scale"]), [1 / k, 1.0], rtol=1e-5)
    # 1/sqrt(k): the voter part scaled by k^-1/2
    lv2 = LV.LeverConfig(fanout="inverse_sqrt", copies=(k, 1))
    g2, _, _ = _lever_step(base, spec, tr, rows, advs, {"voter": 0, "agg": 0}, roles, levers=lv2,
                           copies={"voter": k})
    vrows = set(range(4 * k))
    gv = flat(_ref_grad(base, spec, tr, 0, rows, advs, vrows))
    ga = flat(_ref_grad(base, spec, tr, 0, rows, advs, set(range(4 * k, 4 * k + 4))))
    np.testing.assert_allclose(_slot0(g2), gv / np.sqrt(k) + ga, rtol=2e-4, atol=1e-7)


def test_config_keys_validate_and_build_the_levers():
    from marl_jax import config as common
    from marl_jax.train.loop import lever_config

    c = common.base_config("voting", ("generator", "aggregator"))
    assert lever_config(c, ("generator", "aggregator"), {"generator": 3}) == LV.LeverConfig(
        balance_weights=(1.0, 1.0), balance_cap=0.5, copies=(3, 1))
    c.levers.update(fanout="inverse", damping=0.2, damping_window=32)
    lv = lever_config(c, ("generator", "aggregator"), {"generator": 3})
    assert lv.active and lv.damps and lv.copies == (3, 1)
    common.validate(c)
    c.grpo.diagnostics_every = 2
    with pytest.raises(ValueError, match="diagnostics_every=1"):
        common.validate(c)
    c.grpo.diagnostics_every = 1
    c.policy = "isolated"
    c.levers.balance = "equal"
    with pytest.raises(ValueError, match="policy=shared or balance=none"):
        common.validate(c)
    c.policy = "shared"
    c.levers.damping = 1.5
    with pytest.raises(ValueError, match="levers.damping"):
        common.validate(c)
    c.levers.damping = 0.0
    c.grpo.kl_estimator = "low_var"
    common.validate(c)
    assert LV.kl_estimator("low_var") == "k3"
    with pytest.raises(ValueError, match="kl_estimator"):
        LV.kl_estimator("k2")


@pytest.mark.slow
def test_damping_ema_survives_a_kill_and_resume(prompt_dir, tmp_path):
    """SIGKILL part-way, restart on the same workdir: metrics (damping factors included), parameters and
    each role's gradient EMA are those of the uninterrupted run."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from marl_jax.train.checkpoint import Checkpointer
    from marl_jax.train.loop import TIMING_KEYS
    from marl_jax.train.metrics import read_metrics

    steps, levers = 6, "damping=0.3,damping_window=4"
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = lambda wd: [sys.executable, os.path.join(here, "resume_driver.py"), str(wd), prompt_dir, "shared",
                      str(steps), levers]
    ref, cut = tmp_path / "uninterrupted", tmp_path / "killed"
    subprocess.run(cmd(ref), check=True, capture_output=True, timeout=900)
    proc = subprocess.Popen(cmd(cut), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 900
    while time.time() < deadline:
        done = Checkpointer(str(cut), read_only=True).all_steps() if (cut / "checkpoints").exists() else []
        later = [r["step"] for r in read_metrics(str(cut))] if (cut / "metrics.jsonl").exists() else []
        if done and 2 <= max(done) < steps and max(later, default=0) > max(done):
            break
        if proc.poll() is not None:
            pytest.fail("the run finished before it could be killed; lengthen it")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert max(r["step"] for r in read_metrics(str(cut))) < steps
    subprocess.run(cmd(cut), check=True, capture_output=True, timeout=900)

    strip = lambda recs: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in recs]
    a, b = strip(read_metrics(str(ref))), strip(read_metrics(str(cut)))
    assert a == b
    factors = [r[k] for r in a for k in r if k.endswith("/damping_factor")]
    assert factors and min(factors) < 1.0  # damping acted after the first step
    with Checkpointer(str(ref), read_only=True) as ck:
        sa, _ = ck.restore(steps)
    with Checkpointer(str(cut), read_only=True) as ck:
        sb, _ = ck.restore(steps)
    assert "grad_ema" in sa
    ema = np.concatenate([np.asarray(x).ravel() for x in jax.tree_util.tree_leaves(sa["grad_ema"])])
    assert np.abs(ema).max() > 0
    for x, y in zip(jax.tree_util.tree_leaves(sa), jax.tree_util.tree_leaves(sb)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
