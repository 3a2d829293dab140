"""marl_jax.generate.sampling: top-k / top-p without a sort keep exactly the sort's tokens and draw the same ones.

Two references: `_sort_*` is the sort-based sampler as marl_jax.generate.programs had it (commit c681466),
copied here so the comparison still means something once programs.py calls this module; `_np_kept` is the
kept set by definition, in float64. Random logits can put a value's mass within float32 rounding of top_p,
where any two float32 implementations may disagree: those rows are found in float64 (`margin`) and skipped,
and the tests check that they are rare.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marl_jax.generate import sampling
from marl_jax.generate.types import SamplingParams

INF = np.inf
AMBIGUOUS = 1e-5  # a kept value's mass above within this of top_p: float32 rounding decides


def _sort_masked(scaled, top_k, top_p):
    """The sort-based kept set of programs.sample_tokens (c681466): scaled with the rest at -inf."""
    masked = scaled
    if top_k > 0:
        kth = jax.lax.top_k(scaled, top_k)[0][:, -1:]
        masked = jnp.where(scaled < kth, -jnp.inf, masked)
    if top_p < 1.0:
        srt = -jnp.sort(-masked, axis=-1)
        probs = jax.nn.softmax(srt, axis=-1)
        keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # always keeps the top token
        cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
        masked = jnp.where(masked < cutoff, -jnp.inf, masked)
    return masked


def _sort_sample(logits, keys, sp):
    """programs.sample_tokens as of c681466."""
    scaled = logits if sp.temperature == 0.0 else logits / sp.temperature
    if sp.temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1)
    else:
        tok = jax.vmap(jax.random.categorical)(keys, _sort_masked(scaled, sp.top_k, sp.top_p))
    tok = tok.astype(jnp.int32)
    picked = jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0]
    return tok, picked - jax.nn.logsumexp(scaled, axis=-1)


_sort_sample_jit = jax.jit(_sort_sample, static_argnums=2)
_sample_jit = jax.jit(sampling.sample_tokens, static_argnums=2)
_sort_kept_jit = jax.jit(lambda s, k, p: _sort_masked(s, k, p) > -jnp.inf, static_argnums=(1, 2))
_kept_jit = jax.jit(sampling.kept_mask, static_argnums=(1, 2))


def _np_kept(scaled, top_k=0, top_p=1.0):
    """By definition, in float64: top-k keeps values >= the k-th largest; top-p then keeps each distinct value
    whose renormalised mass strictly above it is < top_p. Returns (kept [B, V], margin [B]): margin is the
    closest any value's mass above comes to top_p."""
    s = np.asarray(scaled, np.float64)
    kept, margin = np.zeros(s.shape, bool), np.full(s.shape[0], INF)
    for b, row in enumerate(s):
        keep = np.ones(row.shape, bool)
        if 0 < top_k < row.size:
            keep = row >= np.sort(row)[::-1][top_k - 1]
        if top_p < 1.0:
            w = np.exp(row[keep] - row.max())
            u, inv = np.unique(row[keep], return_inverse=True)  # distinct values, ascending
            tot = np.bincount(inv, weights=w / w.sum(), minlength=len(u))
            above = np.cumsum(tot[::-1])[::-1] - tot  # mass strictly above each distinct value
            keep &= row >= u[above < top_p].min()
            margin[b] = np.abs(above - top_p).min()
        kept[b] = keep
    return kept, margin


def _keys(n, seed=0):
    return jax.random.split(jax.random.PRNGKey(seed), n)


def _logits(rng, B, V, scale, bf16=False):
    x = jnp.asarray(rng.standard_normal((B, V)) * scale, jnp.float32)
    return x.astype(jnp.bfloat16).astype(jnp.float32) if bf16 else x  # bf16 logits tie a lot


WIDTH = 16  # hand-made rows are right-padded with -30 (negligible mass) to one width: one compile per (k, p)
ALL = None  # every token, padding included

# (top_k, top_p) -> [(name, row, kept tokens)]
HAND = {
    (3, 1.0): [
        ("topk_tie", [3, 2, 2, 2, 1, 0], [0, 1, 2, 3]),  # the 3rd largest value is shared: all its ties kept
        ("topk_no_tie", [3, 2, 1, 0, 1, 2], [0, 1, 5]),
        ("topk_flat", [0.5] * 9, list(range(9))),
    ],
    (0, 0.5): [
        # probs .40/.15/.15/.15/...: the mass above the tied value is .40 < .5, so all three ties are kept
        ("topp_tie_kept", np.log([.40, .15, .15, .15, .05, .05, .05]), [0, 1, 2, 3]),
        ("topp_tie_cut", np.log([.60, .10, .10, .10, .05, .05]), [0]),  # mass above the tie .60 >= .5
        # the tie straddles top_p: mass above it .30 < .5, with it .90
        ("topp_tie_straddles", np.log([.30, .20, .20, .20, .10]), [0, 1, 2, 3]),
        ("topp_order", np.log([.35, .20, .45]), [0, 2]),
        ("topp_below", np.log([.49, .30, .21]), [0, 1]),  # .49 < .5: the second value is kept
        ("topp_above", np.log([.51, .30, .19]), [0]),
        ("topp_flat", [0.5] * 9, list(range(9))),  # all tied: nothing is strictly above any of them
        # the search resolves the last bit: 1 - 2^-24 (one float32 step below 1) has 2/3 of the mass above it
        ("topp_one_ulp", [1.0, 1.0, np.nextafter(np.float32(1), np.float32(0))], [0, 1]),
        ("topp_one_ulp_neg", [-1.0, -1.0, np.nextafter(np.float32(-1), np.float32(-2))], [0, 1]),
    ],
    (3, 0.5): [
        # top-k keeps {5, 4, 4}; renormalised, the mass above 4 is e / (e + 2) = .576 >= .5: top token only
        ("topk_topp", [5, 4, 4, 3, 3, 3], [0]),
        ("topk_topp_tied_top", [4, 4, 4, 4, 3], [0, 1, 2, 3]),
    ],
    (3, 0.9): [
        ("topk_topp_tie_kept", [5, 4, 4, 3, 3, 3], [0, 1, 2]),  # .576 < .9 keeps the tie at 4; 3 is past top-k
        # top-k keeps the 4-way tie at its 3rd value; top-p keeps it (mass above .873 < .9) ...
        ("topk_tie_topp_kept", [4, 3, 1, 1, 1, 1, 0], [0, 1, 2, 3, 4, 5]),
        ("topk_tie_topp_cut", [5, 3, 1, 1, 1, 1, 0], [0, 1]),  # ... or cuts it (.939 >= .9)
    ],
    (0, 0.9): [
        ("one_token_all_mass", [0, 0, 120, 0, 0], [2]),  # the others underflow
        ("peaked", [0, 40, 0, -1], [1]),
        ("topp_below_90", np.log([.50, .39, .11]), [0, 1, 2]),  # .89 < .9
        ("topp_above_90", np.log([.50, .41, .09]), [0, 1]),
    ],
    (0, 1.0): [
        ("topp_1", [1, 0, -1, 5], ALL),
        ("topp_1_all_mass", [0, 0, 120, 0, 0], ALL),
    ],
}


@pytest.mark.parametrize("top_k,top_p", list(HAND), ids=[f"k{k}-p{p}" for k, p in HAND])
def test_hand_made_kept_sets(top_k, top_p):
    cases = HAND[(top_k, top_p)]
    rows = jnp.asarray([list(r) + [-30.0] * (WIDTH - len(r)) for _, r, _ in cases], jnp.float32)
    expected = np.zeros(rows.shape, bool)
    for b, (_, _, idx) in enumerate(cases):
        expected[b, slice(None) if idx is ALL else idx] = True
    names = [c[0] for c in cases]
    for what, got in [("kept_mask", np.asarray(_kept_jit(rows, top_k, top_p))),
                      ("sort", np.asarray(_sort_kept_jit(rows, top_k, top_p))),
                      ("numpy", _np_kept(rows, top_k, top_p)[0])]:
        bad = [n for n, g, e in zip(names, got, expected) if (g != e).any()]
        assert not bad, f"{what}: {bad}"
    # sampling: many draws of each row stay in its kept set and are the sort's draws
    n = 200
    reps = jnp.repeat(rows, n, axis=0)
    sp = SamplingParams(top_k=top_k, top_p=top_p)
    tok, _ = _sample_jit(reps, _keys(len(reps), 1), sp)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(_sort_sample_jit(reps, _keys(len(reps), 1), sp)[0]))
    assert np.repeat(expected, n, axis=0)[np.arange(len(reps)), np.asarray(tok)].all()


@pytest.mark.parametrize("temperature", [1e-3, 1e3])
def test_extreme_temperatures(temperature):
    """Kept sets and tokens of logits / temperature: near-greedy and near-uniform."""
    rng = np.random.default_rng(3)
    logits = _logits(rng, 32, 600, 3.0, bf16=True)
    for top_k, top_p in [(0, 0.9), (20, 0.8)]:
        sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
        scaled = logits / temperature
        want, margin = _np_kept(scaled, top_k, top_p)
        ok = margin > AMBIGUOUS
        assert ok.mean() > 0.9
        np.testing.assert_array_equal(np.asarray(_kept_jit(scaled, top_k, top_p))[ok], want[ok])
        tok, logp = _sample_jit(logits, _keys(32, 4), sp)
        ref_tok, ref_logp = _sort_sample_jit(logits, _keys(32, 4), sp)
        np.testing.assert_array_equal(np.asarray(tok)[ok], np.asarray(ref_tok)[ok])
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=1e-5, atol=1e-5)


CONFIGS = [(0, 0.95), (0, 0.1), (50, 0.95), (7, 0.5), (1, 0.9), (50, 1.0), (0, 1.0)]  # (0, .5): hand-made


def _random_cases():
    rng = np.random.default_rng(0)
    for i, (scale, bf16) in enumerate([(0.01, False), (0.3, True), (1.0, False), (3.0, True), (10.0, False),
                                       (3.0, False), (30.0, True), (1.0, True)]):
        yield i, _logits(rng, 48, 1000, scale, bf16)


def test_kept_mask_matches_sort_and_numpy_on_random_logits():
    skipped = total = 0
    for i, logits in _random_cases():
        for top_k, top_p in CONFIGS:
            got = np.asarray(_kept_jit(logits, top_k, top_p))
            want, margin = _np_kept(logits, top_k, top_p)
            ok = margin > AMBIGUOUS
            skipped, total = skipped + (~ok).sum(), total + ok.size
            np.testing.assert_array_equal(got[ok], want[ok], err_msg=f"case {i} top_k={top_k} top_p={top_p}")
            np.testing.assert_array_equal(got[ok], np.asarray(_sort_kept_jit(logits, top_k, top_p))[ok])
    assert skipped < 0.01 * total, (skipped, total)


def test_tokens_match_sort_on_random_logits():
    """Same keys, same kept set: the same tokens as the sort-based sampler; log-probs untruncated."""
    differ = total = 0
    for i, logits in _random_cases():
        keys = _keys(logits.shape[0], 10 + i)
        for top_k, top_p in CONFIGS + [(None, None)]:
            sp = SamplingParams(temperature=0.0) if top_k is None else SamplingParams(top_k=top_k, top_p=top_p)
            tok, logp = (np.asarray(x) for x in _sample_jit(logits, keys, sp))
            ref_tok, ref_logp = (np.asarray(x) for x in _sort_sample_jit(logits, keys, sp))
            ok = _np_kept(logits, top_k or 0, 1.0 if top_p is None else top_p)[1] > AMBIGUOUS
            np.testing.assert_array_equal(tok[ok], ref_tok[ok], err_msg=f"case {i} top_k={top_k} top_p={top_p}")
            differ, total = differ + (tok != ref_tok).sum(), total + tok.size
            full = jax.nn.log_softmax(logits, axis=-1)
            np.testing.assert_allclose(logp, np.asarray(full)[np.arange(len(tok)), tok], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
    assert differ <= 0.002 * total, (differ, total)


def test_reference_is_programs_sampler():
    """The frozen reference draws what the sampler's programs draw (marl_jax.generate.programs imports
    sample_tokens from this module)."""
    from marl_jax.generate import programs

    logits = dict(_random_cases())[3]
    for sp in [SamplingParams(top_p=0.95), SamplingParams(top_k=50, top_p=0.95)]:
        tok = jax.jit(programs.sample_tokens, static_argnums=2)(logits, _keys(48, 2), sp)[0]
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(_sort_sample_jit(logits, _keys(48, 2), sp)[0]))


def test_fallback_path_matches_sort(monkeypatch):
    """One Gumbel candidate per row: top-p misses it often, and the exact search then picks the token."""
    monkeypatch.setattr(sampling, "_num_candidates", lambda top_p, batch: 1)
    sample = jax.jit(sampling.sample_tokens, static_argnums=2)
    rng = np.random.default_rng(5)
    for scale, bf16, top_p in [(0.1, False, 0.5), (2.0, True, 0.3)]:
        logits = _logits(rng, 64, 800, scale, bf16)
        keys = _keys(64, 7)
        sp = SamplingParams(top_p=top_p)
        tok, logp = (np.asarray(x) for x in sample(logits, keys, sp))
        ref_tok, ref_logp = (np.asarray(x) for x in _sort_sample_jit(logits, keys, sp))
        ok = _np_kept(logits, 0, top_p)[1] > AMBIGUOUS
        np.testing.assert_array_equal(tok[ok], ref_tok[ok])
        np.testing.assert_allclose(logp, ref_logp, rtol=1e-5, atol=1e-5)
        # the fallback did run: the top logit + noise token is outside the kept set in some rows
        first = np.asarray(jnp.argmax(logits + sampling._gumbel(keys, logits), axis=-1))
        assert (~_np_kept(logits, 0, top_p)[0][np.arange(64), first]).any()


def test_minus_inf_logits():
    """Tokens masked to -inf (a vocabulary mask) are never drawn, and the rest is unchanged."""
    rng = np.random.default_rng(6)
    logits = np.array(_logits(rng, 48, 1000, 2.0))  # the shape and configs of the tests above: no new compiles
    logits[:, 200:] = -INF
    logits[3, 1:] = -INF  # one finite token
    logits = jnp.asarray(logits)
    for top_k, top_p in [(0, 0.95), (50, 0.95), (0, 1.0)]:
        sp = SamplingParams(top_k=top_k, top_p=top_p)
        tok, logp = _sample_jit(logits, _keys(48, 8), sp)
        ref_tok, ref_logp = _sort_sample_jit(logits, _keys(48, 8), sp)
        np.testing.assert_array_equal(np.asarray(tok), np.asarray(ref_tok))
        np.testing.assert_allclose(np.asarray(logp), np.asarray(ref_logp), rtol=1e-5, atol=1e-5)
        assert (np.asarray(tok) < 200).all() and int(tok[3]) == 0


@pytest.mark.parametrize("top_k,top_p", [(0, 0.7), (4, 0.9), (0, 0.95), (3, 1.0)])
def test_empirical_distribution(top_k, top_p):
    """Over many keys the draws follow softmax renormalised over the kept set (ties included)."""
    row = np.array([2.0, 1.5, 1.5, 1.0, 0.5, 0.5, 0.5, 0.0, -1.0, -3.0], np.float32)
    N = 40_000
    tok, _ = _sample_jit(jnp.asarray(np.tile(row, (N, 1))), _keys(N, 9), SamplingParams(top_k=top_k, top_p=top_p))
    counts = np.bincount(np.asarray(tok), minlength=row.size)
    kept = _np_kept(row[None], top_k, top_p)[0][0]
    p = np.where(kept, np.exp(row - row.max()), 0.0)
    p /= p.sum()
    assert counts[~kept].sum() == 0
    sigma = np.sqrt(N * p * (1 - p))
    assert (np.abs(counts - N * p) <= 5 * sigma + 1).all(), (counts, N * p)


def test_greedy():
    rng = np.random.default_rng(7)
    logits = _logits(rng, 8, 300, 3.0, bf16=True)
    tok, logp = _sample_jit(logits, _keys(8), SamplingParams(temperature=0.0))
    np.testing.assert_array_equal(np.asarray(tok), np.argmax(np.asarray(logits), -1))
    full = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(logp), full[np.arange(8), np.asarray(tok)], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_k,top_p", [(0, 0.95), (50, 0.95), (0, 1.0), (50, 1.0)])
def test_no_sort(top_k, top_p):
    """The point of the module: no sort of the vocabulary in the program."""
    jaxpr = str(jax.make_jaxpr(lambda l, k: sampling.sample_tokens(l, k, SamplingParams(top_k=top_k, top_p=top_p)))(
        jnp.zeros((4, 1000)), _keys(4)))
    assert not re.search(r"\bsort\[", jaxpr)
    assert re.search(r"\bsort\[", str(jax.make_jaxpr(lambda s: _sort_masked(s, top_k, 0.5))(jnp.zeros((4, 1000)))))
