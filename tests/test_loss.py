"""Policy loss against hand-worked numbers and a plain-Python reference written from the formulas."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.rl.loss import (
    combine_stats,
    finalize_stats,
    policy_loss,
    policy_loss_denominator,
    policy_loss_stats,
    policy_loss_terms,
    token_entropy,
    token_logprobs,
)

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


# ---- plain-Python reference (no jax, no numpy vector ops) -------------------------------------------
def ref_token_pg(lp, olp, a, cl=0.2, ch=0.28, dc=3.0):
    r = math.exp(lp - olp)
    pg1 = -a * r
    pg2 = -a * min(max(r, 1 - cl), 1 + ch)
    c = max(pg1, pg2)
    if dc is not None and a < 0:
        c = min(c, -a * dc)
    return c


def ref_agg(tok, mask, mode, rows_real, max_len_norm=None):
    """tok, mask: lists of lists; rows_real: list of bools."""
    T = len(mask[0])
    if mode == "token-mean":
        s = n = 0.0
        for i, row in enumerate(tok):
            for t, x in enumerate(row):
                if rows_real[i] and mask[i][t]:
                    s += x
                    n += 1
        return s / n
    seq_vals = []
    for i, row in enumerate(tok):
        if not rows_real[i]:
            continue
        s = sum(x for t, x in enumerate(row) if mask[i][t])
        n = sum(1 for t in range(T) if mask[i][t])
        if mode == "seq-mean-token-mean":
            if n:
                seq_vals.append(s / n)
        else:
            seq_vals.append(s / (T if max_len_norm is None else max_len_norm))
    return sum(seq_vals) / len(seq_vals)


def _one_token(lp_minus_old, adv, **kw):
    logp = jnp.array([[lp_minus_old]], jnp.float32)
    return policy_loss(logp, jnp.zeros((1, 1)), jnp.array([adv], jnp.float32), jnp.ones((1, 1)), **kw)


# ---- clipping ---------------------------------------------------------------------------------------
def test_clip_high_side_positive_advantage():
    # ratio = e^0.5 = 1.6487 > 1.28, A = +1: min(r, 1.28) wins -> loss = -1.28, clipped.
    loss, m = _one_token(0.5, 1.0)
    assert float(loss) == pytest.approx(-1.28, abs=1e-6)
    assert float(m["clip_frac"]) == 1.0 and float(m["clip_frac_high"]) == 1.0
    assert float(m["clip_frac_low"]) == 0.0 and float(m["dual_clip_frac"]) == 0.0


def test_clip_low_side_negative_advantage():
    # ratio = e^-0.5 = 0.6065 < 0.8, A = -1: -A*r = 0.6065, -A*0.8 = 0.8, max -> 0.8, clipped.
    loss, m = _one_token(-0.5, -1.0)
    assert float(loss) == pytest.approx(0.8, abs=1e-6)
    assert float(m["clip_frac"]) == 1.0 and float(m["clip_frac_low"]) == 1.0
    assert float(m["clip_frac_high"]) == 0.0


def test_unclipped_sides():
    # A = +1 with ratio below range: not clipped (pessimistic max keeps -r).
    loss, m = _one_token(-0.5, 1.0)
    assert float(loss) == pytest.approx(-math.exp(-0.5), abs=1e-6)
    assert float(m["clip_frac"]) == 0.0
    # A = -1 with ratio above range but under the dual clip: loss = r = e^0.5.
    loss, m = _one_token(0.5, -1.0)
    assert float(loss) == pytest.approx(math.exp(0.5), abs=1e-6)
    assert float(m["clip_frac"]) == 0.0 and float(m["dual_clip_frac"]) == 0.0


def test_dual_clip_caps_large_ratio_with_negative_advantage():
    # ratio = e^1.5 = 4.4817, A = -2: pg1 = 8.963, pg2 = 2.56, max = 8.963 > pg3 = 2*3 = 6 -> 6.
    loss, m = _one_token(1.5, -2.0)
    assert float(loss) == pytest.approx(6.0, abs=1e-5)
    assert float(m["dual_clip_frac"]) == 1.0 and float(m["clip_frac"]) == 0.0
    loss, m = _one_token(1.5, -2.0, dual_clip=None)
    assert float(loss) == pytest.approx(2 * math.exp(1.5), rel=1e-6)
    assert float(m["dual_clip_frac"]) == 0.0
    # Positive advantage is never dual-clipped.
    loss, _ = _one_token(1.5, 2.0)
    assert float(loss) == pytest.approx(-2 * 1.28, abs=1e-5)


def test_clip_fraction_metrics_over_masked_tokens():
    # Row 0: tokens [clip-high, unclipped, (masked, would be clip-low)]; row 1: [clip-low, dual, unclipped].
    d = [[0.5, 0.0, -0.5], [-0.5, 1.5, 0.1]]
    adv = [1.0, -1.0]
    mask = [[1, 1, 0], [1, 1, 1]]
    loss, m = policy_loss(jnp.array(d), jnp.zeros((2, 3)), jnp.array(adv), jnp.array(mask, jnp.float32))
    # 5 masked tokens: clipped = {r0t0 high, r1t0 low}; dual = {r1t1: 4.48 > 3}.
    assert float(m["clip_frac"]) == pytest.approx(2 / 5)
    assert float(m["clip_frac_high"]) == pytest.approx(1 / 5)
    assert float(m["clip_frac_low"]) == pytest.approx(1 / 5)
    assert float(m["dual_clip_frac"]) == pytest.approx(1 / 5)
    ratios = [math.exp(x) for i, row in enumerate(d) for t, x in enumerate(row) if mask[i][t]]
    assert float(m["ratio_mean"]) == pytest.approx(sum(ratios) / 5, rel=1e-6)
    assert float(m["ratio_max"]) == pytest.approx(max(ratios), rel=1e-6)
    assert float(m["approx_kl"]) == pytest.approx(-sum(math.log(r) for r in ratios) / 5, abs=1e-6)
    # Row means: row0 (-1.28 - 1)/2 ; row1 (0.8 + 3 + e^0.1)/3.
    expected = ((-1.28 - 1.0) / 2 + (0.8 + 3.0 + math.exp(0.1)) / 3) / 2
    assert float(loss) == pytest.approx(expected, abs=1e-6)
    assert float(m["pg_loss"]) == pytest.approx(expected, abs=1e-6)


# ---- aggregation ------------------------------------------------------------------------------------
def _batch(seed=0, n=5, t=6):
    rng = np.random.default_rng(seed)
    logp = rng.normal(-1.0, 0.5, (n, t))
    old = logp + rng.normal(0.0, 0.4, (n, t))
    ref = logp + rng.normal(0.0, 0.6, (n, t))
    ent = rng.uniform(0.0, 3.0, (n, t))
    adv = rng.normal(0.0, 1.0, n)
    lengths = rng.integers(1, t + 1, n)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[1] = 0.0  # a row with no completion token
    mask[2, 0] = 0.0  # prompt-side hole
    return logp, old, ref, ent, adv, mask


@pytest.mark.parametrize("mode", MODES)
def test_aggregation_modes_against_reference(mode):
    logp, old, ref, ent, adv, mask = _batch()
    loss, m = policy_loss(jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask), agg=mode)
    tok = [[ref_token_pg(logp[i, t], old[i, t], adv[i]) for t in range(6)] for i in range(5)]
    expected = ref_agg(tok, mask.tolist(), mode, [True] * 5)
    assert float(loss) == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_aggregation_modes_differ_by_hand():
    # Row 0: one token, loss -1 (A=1, r=1); row 1: three tokens of loss -1 each; T = 4.
    mask = jnp.array([[1, 0, 0, 0], [1, 1, 1, 0]], jnp.float32)
    z = jnp.zeros((2, 4))
    adv = jnp.array([1.0, 1.0])
    val = lambda **kw: float(policy_loss(z, z, adv, mask, **kw)[0])
    assert val(agg="token-mean") == pytest.approx(-1.0)  # -4 / 4 tokens
    assert val(agg="seq-mean-token-mean") == pytest.approx(-1.0)  # (-1 + -1) / 2
    assert val(agg="seq-mean-token-sum-norm") == pytest.approx((-1 / 4 - 3 / 4) / 2)
    assert val(agg="seq-mean-token-sum-norm", max_len_norm=8) == pytest.approx((-1 / 8 - 3 / 8) / 2)
    adv2 = jnp.array([2.0, 1.0])  # now the weighting matters
    val2 = lambda **kw: float(policy_loss(z, z, adv2, mask, **kw)[0])
    assert val2(agg="token-mean") == pytest.approx(-5 / 4)
    assert val2(agg="seq-mean-token-mean") == pytest.approx(-3 / 2)
    assert val2(agg="seq-mean-token-sum-norm") == pytest.approx((-2 / 4 - 3 / 4) / 2)


# ---- KL and entropy ---------------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("mode", MODES)
def test_kl_term(estimator, mode):
    logp, old, ref, ent, adv, mask = _batch(1)
    ref[0, 0] = logp[0, 0] + 5.0  # k3 = e^5 - 6 = 142.4, clamped to 10
    mask[0, 0] = 1.0

    def k(lp, rf):
        if estimator == "k1":
            return lp - rf
        d = rf - lp
        return min(max(math.exp(d) - d - 1, -10.0), 10.0)

    args = (jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask))
    base, _ = policy_loss(*args, agg=mode)
    loss, m = policy_loss(*args, agg=mode, ref_logp=jnp.array(ref), kl_coef=0.3, kl_estimator=estimator)
    kl_tok = [[k(logp[i, t], ref[i, t]) for t in range(6)] for i in range(5)]
    expected_kl = ref_agg(kl_tok, mask.tolist(), mode, [True] * 5)
    assert float(loss - base) == pytest.approx(0.3 * expected_kl, rel=1e-4, abs=1e-6)
    flat = [kl_tok[i][t] for i in range(5) for t in range(6) if mask[i][t]]
    assert float(m["kl"]) == pytest.approx(sum(flat) / len(flat), rel=1e-5)
    if estimator == "k3":
        assert kl_tok[0][0] == 10.0


def test_k3_hand_value():
    # logp = -1, ref = -1.5: d = -0.5, k3 = e^-0.5 + 0.5 - 1 = 0.1065307; A = 0 so only KL counts.
    one = jnp.ones((1, 1))
    loss, m = policy_loss(-one, -one, jnp.zeros(1), one, ref_logp=-1.5 * one, kl_coef=1.0)
    assert float(loss) == pytest.approx(math.exp(-0.5) - 0.5, abs=1e-6)
    assert float(m["kl"]) == pytest.approx(0.10653066, abs=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_entropy_term(mode):
    logp, old, ref, ent, adv, mask = _batch(2)
    args = (jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask))
    base, _ = policy_loss(*args, agg=mode)
    loss, m = policy_loss(*args, agg=mode, entropy=jnp.array(ent), entropy_coef=0.05)
    expected = ref_agg(ent.tolist(), mask.tolist(), mode, [True] * 5)
    assert float(loss - base) == pytest.approx(-0.05 * expected, rel=1e-4)
    flat = [ent[i, t] for i in range(5) for t in range(6) if mask[i, t]]
    assert float(m["entropy"]) == pytest.approx(sum(flat) / len(flat), rel=1e-5)


def test_token_logprobs_and_entropy_by_hand():
    logits = np.array([[[0.0, math.log(2.0), math.log(3.0)], [1000.0, 0.0, -1000.0]]], np.float32)
    targets = np.array([[2, 1]])
    lp = np.asarray(token_logprobs(jnp.array(logits), jnp.array(targets)))
    # Row 0: p = (1, 2, 3)/6 -> log(3/6); row 1: huge logits stay finite: log p(1) = -1000.
    np.testing.assert_allclose(lp, [[math.log(0.5), -1000.0]], rtol=1e-6)
    ent = np.asarray(token_entropy(jnp.array(logits)))
    h0 = -sum(p * math.log(p) for p in (1 / 6, 2 / 6, 3 / 6))
    np.testing.assert_allclose(ent, [[h0, 0.0]], atol=1e-6)
    # -inf logits (a banned token) contribute nothing rather than nan.
    ent_inf = token_entropy(jnp.array([[[0.0, 0.0, -jnp.inf]]]))
    assert float(ent_inf[0, 0]) == pytest.approx(math.log(2.0), rel=1e-6)
    assert lp.dtype == np.float32


# ---- padding rows -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_padding_rows_ignored(mode):
    logp, old, ref, ent, adv, mask = _batch(3)
    kw = dict(agg=mode, ref_logp=None, entropy=None)
    loss, m = policy_loss(jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask), **kw)
    # Pad with 3 rows of garbage (nan/inf log-probs, huge advantages, full masks) marked row_weight 0.
    pad = np.full((3, 6), np.nan)
    pad[1] = np.inf
    P = lambda a, fill: np.concatenate([a, fill], 0)
    lp2, old2 = P(logp, pad), P(old, -pad)
    adv2 = P(adv, np.array([1e6, -1e6, np.nan]))
    mask2 = P(mask, np.ones((3, 6), np.float32))
    rw = np.array([1] * 5 + [0] * 3, np.float32)
    fn = lambda lp: policy_loss(lp, jnp.array(old2), jnp.array(adv2), jnp.array(mask2), row_weight=jnp.array(rw), **kw)
    loss2, m2 = fn(jnp.array(lp2))
    assert float(loss2) == pytest.approx(float(loss), rel=1e-6, abs=1e-7)
    for k in m:
        assert float(m2[k]) == pytest.approx(float(m[k]), rel=1e-6, abs=1e-7), k
    g = jax.grad(lambda lp: fn(lp)[0])(jnp.array(lp2))
    assert np.all(np.isfinite(np.asarray(g))) and np.all(np.asarray(g)[5:] == 0)
    expected = ref_agg(
        [[ref_token_pg(logp[i, t], old[i, t], adv[i]) for t in range(6)] for i in range(5)] + [[0.0] * 6] * 3,
        mask2.tolist(), mode, [True] * 5 + [False] * 3,
    )
    assert float(loss2) == pytest.approx(expected, rel=1e-5, abs=1e-6)


# ---- gradient ---------------------------------------------------------------------------------------
def test_gradient_matches_hand_derivation_and_finite_differences():
    # Two rows, seq-mean-token-mean. Row 0 (A=+1, len 2): t0 unclipped (r=e^0.1), t1 clipped high (r=e^0.5).
    # Row 1 (A=-1, len 3): t0 unclipped (r=e^-0.1), t1 clipped low (r=e^-0.5), t2 dual-capped (r=e^1.5).
    d = np.array([[0.1, 0.5, 0.0], [-0.1, -0.5, 1.5]], np.float32)
    old = np.full((2, 3), -2.0, np.float32)
    logp = old + d
    adv = jnp.array([1.0, -1.0])
    mask = jnp.array([[1, 1, 0], [1, 1, 1]], jnp.float32)
    ref = logp - 0.3  # k3 with d = ref - logp = -0.3: dk3/dlogp = 1 - e^-0.3
    f = lambda lp: policy_loss(lp, jnp.array(old), adv, mask, ref_logp=jnp.array(ref), kl_coef=0.1)[0]
    g = np.asarray(jax.grad(f)(jnp.array(logp)))
    # d(-A r)/dlogp = -A r on the unclipped branch; clipped/dual-capped branches are constant.
    dk = 0.1 * (1 - math.exp(-0.3))
    expected = np.array(
        [
            [(-math.exp(0.1) + dk) / 2 / 2, (0.0 + dk) / 2 / 2, 0.0],
            [(math.exp(-0.1) + dk) / 3 / 2, (0.0 + dk) / 3 / 2, (0.0 + dk) / 3 / 2],
        ]
    )
    np.testing.assert_allclose(g, expected, rtol=1e-5, atol=1e-7)
    # Central finite differences (away from the kinks) agree.
    h = 1e-2
    fd = np.zeros_like(logp)
    for i in range(2):
        for t in range(3):
            e = np.zeros_like(logp)
            e[i, t] = h
            fd[i, t] = (float(f(jnp.array(logp + e))) - float(f(jnp.array(logp - e)))) / (2 * h)
    np.testing.assert_allclose(fd, expected, rtol=2e-3, atol=2e-4)


# ---- micro-batch accumulation -----------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_microbatch_accumulation_is_exact(mode):
    n, t = 8, 6
    logp, old, ref, ent, adv, mask = _batch(4, n=n, t=t)
    rw = np.array([1, 1, 1, 0, 1, 1, 1, 0], np.float32)  # padding rows inside micro-batches
    kw = dict(agg=mode, kl_coef=0.2, entropy_coef=0.01, kl_estimator="k3")
    J = jnp.array
    full, full_m = policy_loss(J(logp), J(old), J(adv), J(mask), ref_logp=J(ref), entropy=J(ent), row_weight=J(rw), **kw)
    splits = [(0, 3), (3, 4), (4, 8)]
    num = den = 0.0
    stats = None
    for a, b in splits:
        s = slice(a, b)
        nu, de = policy_loss_terms(J(logp[s]), J(old[s]), J(adv[s]), J(mask[s]), ref_logp=J(ref[s]),
                                   entropy=J(ent[s]), row_weight=J(rw[s]), **kw)
        num, den = num + nu, den + de
        st = policy_loss_stats(J(logp[s]), J(old[s]), J(adv[s]), J(mask[s]), ref_logp=J(ref[s]), entropy=J(ent[s]),
                               row_weight=J(rw[s]), agg=mode, kl_estimator="k3")
        stats = st if stats is None else combine_stats(stats, st)
        assert float(de) == float(policy_loss_denominator(J(mask[s]), agg=mode, row_weight=J(rw[s])))
    assert float(num / den) == pytest.approx(float(full), rel=1e-6, abs=1e-7)
    acc_m = finalize_stats(stats)
    for k in full_m:
        assert float(acc_m[k]) == pytest.approx(float(full_m[k]), rel=1e-5, abs=1e-7), k

    # Gradients accumulate exactly too: sum_i d(num_i)/dlogp / D equals the full gradient.
    D = float(den)
    g_full = np.asarray(jax.grad(lambda lp: policy_loss(lp, J(old), J(adv), J(mask), ref_logp=J(ref), entropy=J(ent),
                                                         row_weight=J(rw), **kw)[0])(J(logp)))
    parts = []
    for a, b in splits:
        s = slice(a, b)
        gnum = jax.grad(lambda lp: policy_loss_terms(lp, J(old[s]), J(adv[s]), J(mask[s]), ref_logp=J(ref[s]),
                                                     entropy=J(ent[s]), row_weight=J(rw[s]), **kw)[0])(J(logp[s]))
        parts.append(np.asarray(gnum) / D)
    np.testing.assert_allclose(np.concatenate(parts), g_full, rtol=1e-5, atol=1e-8)


def test_denominators_by_hand():
    mask = jnp.array([[1, 1, 0], [0, 0, 0], [1, 0, 0], [1, 1, 1]], jnp.float32)
    rw = jnp.array([1.0, 1.0, 1.0, 0.0])
    assert float(policy_loss_denominator(mask, agg="token-mean", row_weight=rw)) == 3
    assert float(policy_loss_denominator(mask, agg="seq-mean-token-mean", row_weight=rw)) == 2
    assert float(policy_loss_denominator(mask, agg="seq-mean-token-sum-norm", row_weight=rw)) == 3
    assert float(policy_loss_denominator(mask, agg="seq-mean-token-sum-norm")) == 4


# ---- jit and errors ---------------------------------------------------------------------------------
def test_jit_and_vmap_over_slots():
    logp, old, ref, ent, adv, mask = _batch(5)
    fn = jax.jit(functools.partial(policy_loss, agg="seq-mean-token-mean", kl_coef=0.1))
    eager, _ = policy_loss(jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask), ref_logp=jnp.array(ref), kl_coef=0.1)
    jitted, _ = fn(jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask), ref_logp=jnp.array(ref))
    assert float(jitted) == pytest.approx(float(eager), rel=1e-6)
    # Per-slot coefficients as arrays under vmap: slot 0 kl_coef 0 reduces to no KL.
    stack = lambda a: jnp.stack([jnp.array(a), jnp.array(a)])
    per_slot = jax.vmap(lambda lp, o, a, m, r, c: policy_loss(lp, o, a, m, ref_logp=r, kl_coef=c)[0])(
        stack(logp), stack(old), stack(adv), stack(mask), stack(ref), jnp.array([0.0, 0.1]))
    no_kl, _ = policy_loss(jnp.array(logp), jnp.array(old), jnp.array(adv), jnp.array(mask))
    np.testing.assert_allclose(np.asarray(per_slot), [float(no_kl), float(eager)], rtol=1e-6)


def test_bad_options_raise():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="agg"):
        policy_loss(z, z, jnp.zeros(1), z, agg="mean")
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(z, z, jnp.zeros(1), z, kl_coef=0.1)
    with pytest.raises(ValueError, match="dual_clip"):
        policy_loss(z, z, jnp.zeros(1), z, dual_clip=0.5)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(z, z, jnp.zeros(3), z)
    with pytest.raises(ValueError, match="kl_estimator"):
        policy_loss(z, z, jnp.zeros(1), z, kl_estimator="k9")


# ---- the sampler's log-probs against the trainer's; truncated importance sampling --------------------
def test_logp_gap_stats_by_hand():
    """Sampler log-probs 0.1 below the trainer's on both tokens of a row: |gap| = 0.1 per token and
    k3 = r - 1 - log r with r = p_trainer / p_sampler = e^0.1, i.e. e^0.1 - 1.1 = 0.0051709; the padding token
    (mask 0) counts nowhere. The opposite shift gives e^-0.1 - 0.9 = 0.0048374: the estimator is not symmetric,
    so a swapped sign would show."""
    lp = jnp.array([[-1.0, -2.0, -7.0]])
    mask = jnp.array([[1.0, 1.0, 0.0]])
    for shift, k3 in ((-0.1, math.exp(0.1) - 1.1), (0.1, math.exp(-0.1) - 0.9)):
        st = policy_loss_stats(lp, lp, jnp.array([1.0]), mask, sampler_logp=lp + shift)
        np.testing.assert_allclose(float(st["logp_gap_abs"]), 0.2, rtol=1e-5)
        np.testing.assert_allclose(float(st["logp_gap_k3"]), 2 * k3, rtol=1e-4)
        fin = finalize_stats(st)
        np.testing.assert_allclose(float(fin["logp_gap_mean_abs"]), 0.1, rtol=1e-5)
        np.testing.assert_allclose(float(fin["logp_gap_k3"]), k3, rtol=1e-4)
    assert "logp_gap_abs" not in policy_loss_stats(lp, lp, jnp.array([1.0]), mask)


@pytest.mark.parametrize("cap,w", [(2.0, math.exp(0.1)), (1.05, 1.05)])
def test_truncated_importance_sampling_by_hand(cap, w):
    """One row of two tokens, A = 1, old = logp (recompute: ratio 1), sampler = logp - 0.1: each token's pg term
    -A * ratio = -1 is weighted by w = min(e^0.1, C), so the seq-mean-token-mean numerator is -w and its gradient
    -w / 2 per token; the weight carries no gradient. A token whose ratio is clipped (logp - old = 0.5 > log 1.28)
    keeps its clipped value, times w, and no gradient."""
    lp = jnp.array([[-1.0, -2.0]])
    mask, adv = jnp.ones((1, 2)), jnp.array([1.0])
    sg = jax.lax.stop_gradient

    def num(x, old, tis):
        return policy_loss_terms(x, old, adv, mask, sampler_logp=sg(x) - 0.1, tis_cap=tis)[0]

    np.testing.assert_allclose(float(num(lp, lp, 0.0)), -1.0, rtol=1e-6)
    np.testing.assert_allclose(float(num(lp, lp, cap)), -w, rtol=1e-6)
    g = jax.grad(lambda x: num(x, sg(x), cap))(lp)
    np.testing.assert_allclose(np.asarray(g), [[-w / 2, -w / 2]], rtol=1e-5)
    g_plain = jax.grad(lambda x: num(x, sg(x), 0.0))(lp)
    np.testing.assert_allclose(np.asarray(g), w * np.asarray(g_plain), rtol=1e-6)
    np.testing.assert_allclose(float(num(lp, lp - 0.5, cap)), -1.28 * w, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.grad(lambda x: num(x, lp - 0.5, cap))(lp)), 0.0, atol=1e-7)
    st = policy_loss_stats(lp, lp, adv, mask, sampler_logp=lp - 0.1, tis_cap=cap)
    assert float(finalize_stats(st)["tis_capped_frac"]) == (1.0 if cap < math.exp(0.1) else 0.0)
    np.testing.assert_allclose(float(finalize_stats(st)["pg_loss"]), -w, rtol=1e-6)  # the stats see the weight


def test_truncated_importance_sampling_needs_a_cap_and_the_sampler():
    lp, mask, adv = jnp.zeros((1, 2)), jnp.ones((1, 2)), jnp.ones((1,))
    with pytest.raises(ValueError, match="pass sampler_logp"):
        policy_loss_terms(lp, lp, adv, mask, tis_cap=2.0)
    with pytest.raises(ValueError, match="tis_cap must be >= 0"):
        policy_loss_terms(lp, lp, adv, mask, sampler_logp=lp, tis_cap=-1.0)
