"""Token sampling (greedy, temperature, top-k, top-p) without sorting the vocabulary.

`sample_tokens(logits, keys, sp)` draws the tokens the sort-based sampler drew (same keys, same kept set:
`jax.vmap(jax.random.categorical)(keys, masked)`) and returns their log-probs under the untruncated
softmax(logits / temperature); `kept_mask` is the kept set itself. A pass below is one read of the f32 logits
[B, V] (39 MB at B = 64, 156 MB at B = 256 for V = 151936).

How, by case (s = logits / temperature):
  - top-k (0 < k < V), with or without top-p: `lax.top_k` lists every token above the k-th value, so the
    sort's cumsum test run on that list finds the same top-p cutoff; one more pass sums exp(s - max) over the
    row (the log-prob's normaliser and the top-k one, which counts ties at the k-th value past the list);
    one pass draws categorical over the masked row. 3 passes, exact, no fallback.
  - top-p alone: categorical(masked) is argmax(masked + g), g the Gumbel noise categorical draws from the
    key, so the token is the first token in decreasing s + g that top-p keeps. The top J of s + g (one
    pass: the noise is fused into XLA:TPU's TopK) are the candidates; top-p keeps a value v iff the mass
    strictly above it is < top_p, a threshold sum, and one pass computes it for all J candidates and the
    normaliser. 2 passes. The candidates are J draws without replacement from softmax(s); while none is
    kept, the next one falls in the kept set (mass >= top_p) with probability >= top_p, however flat the
    row (a random-init model's top-p set holds most of the vocabulary: no matter). So a row has no kept
    candidate with probability <= (1 - top_p)^J; J is the smallest of 16, 32, 64 with B (1 - top_p)^J <=
    1e-4. Then, for the whole batch (lax.cond), an exact search finds the cutoff: 16-way over the float's 32
    order-preserving bits, 15 thresholds a pass, 8 passes (12 passes in all). How often, at B = 256 (upper
    bounds): top_p = 0.95 (J = 16) 4e-19 of steps; 0.5 (J = 32) 6e-8; 0.2 (J = 64) 2e-4; 0.1 (J = 64) 0.3.
  - greedy and top-p = 1 (no top-k): as before (argmax or categorical, then logsumexp).

Measured: compiled for one TPU v5p chip (deviceless, libtpu), V = 151936, f32 logits, top_p = 0.95; bytes
are marl_jax.hlo_bytes' HBM count of the optimized HLO (operands + outputs of top-level instructions,
loops x trip counts, a conditional at its larger branch), in passes; "lm_head" compiles
`sample_tokens(h @ W)` (h [B, 1024], W [1024, V] bf16, Qwen3-0.6B's head) and subtracts the read of W and h,
so it counts writing the logits (1 pass) and the layouts XLA picks when the logits are not a parameter.

                                        B = 64            B = 256
                                    logits  lm_head   logits  lm_head
    top_p = 0.95      sort            24.1    22.1      31.1    31.1
                      this, common     2.0     3.0       2.0     3.0
                      this, fallback   2.0     3.0      12.0    13.0
    top_k = 50,       sort            25.1    26.1      39.1    39.1
    top_p = 0.95      this             2.0     3.0       5.0     4.0
    top_k = 50        sort             5.0     6.0      12.0    12.0
                      this             2.0     3.0       3.0     4.0

At B = 64 XLA:TPU keeps the [64, V] logits in VMEM after one HBM read, so later passes move no HBM bytes;
counting every memory space (hbm_only=False) the logits-parameter program is 33.1 passes (sort) vs 4.0
(common branch) and 14.0 (fallback) at top_p = 0.95, 38.1 vs 5.0 with top_k = 50. XLA's cost_analysis
"bytes accessed" at top_p = 0.95 (its loop bodies counted once): sort 1622 MB vs 270 MB common branch
(427 MB with the conditional) at B = 64, 4925 MB vs 454 MB (1082 MB) at B = 256. CPU (2 shared cores,
B = 64, V = 151936): 3.8 s -> 0.8 s a call at top_p = 0.95, 5.0 s -> 0.63 s with top_k = 50.

Why not: the sort (above); a binary search over the float's bits (vLLM tpu-inference's binary_search.py):
32+ passes every step; top-p inside the largest K logits (`lax.top_k`, one pass): exact only when they hold
top_p of the mass, never for a flat row, so its fallback would run every step on a random-init model;
`lax.approx_max_k`: approximate; rejection sampling (FlashInfer): same distribution, different draws.

XLA:TPU traps, measured: one reduction over a [B, J, V] broadcast writes exp(s - r) to HBM first (4 passes
instead of 2; `_masses` keeps J sibling reductions, which fuse into one pass); a TopK whose only uses are
slices is rewritten into a sort of the whole row (top_k = 50, B = 256: 12 passes instead of 4, the sort
row "top_k = 50" above has it), which the optimization barrier in `_topk_cutoff` prevents.

Rounding: the threshold sums and the sort's cumsum round differently, so a value whose mass above lies
within float32 rounding of top_p (~1e-6) can be kept by one and not the other (as by any two float32
implementations); tests/test_sampling.py finds such rows in float64 and checks that they are rare.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from marl_jax.generate.types import SamplingParams

_WAYS = 16  # the exact search splits its interval 16 ways per pass: 4 of the float's 32 bits, 8 passes
_MISS_RATE = 1e-4  # J is chosen so that at most this fraction of steps falls back (a bound; unless capped)
_MAX_CANDIDATES = 64  # each candidate is one more threshold sum per token in the candidates' pass


def _gumbel(keys: jax.Array, like: jax.Array) -> jax.Array:
    """The noise jax.random.categorical(key, row) adds to each row: same keys, same draws."""
    return jax.vmap(lambda k: jax.random.gumbel(k, like.shape[1:], like.dtype))(keys)


def _masses(s: jax.Array, r: jax.Array, t: jax.Array, strict: bool) -> jax.Array:
    """Sum of exp(s - r) over the tokens above each threshold: s [B, V], r [B, 1], t [B, J] -> [B, J].

    One reduction per threshold, side by side: XLA fuses them into one pass over s that computes exp once
    per token (one reduction over a [B, J, V] broadcast makes XLA:TPU write exp(s - r) to memory first)."""
    e = jnp.exp(s.astype(jnp.float32) - r.astype(jnp.float32))
    above = (lambda tj: s > tj) if strict else (lambda tj: s >= tj)
    return jnp.stack([jnp.sum(jnp.where(above(t[:, j:j + 1]), e, 0.0), axis=-1) for j in range(t.shape[1])], -1)


def _topk_cutoff(s: jax.Array, k: int, top_p: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(cutoff [B, 1], row max [B, 1], sum of exp(s - max) [B, 1]) for top-k (k < V) then top-p.

    The top-k list holds every token above its k-th value, so the sorted cumsum of the reference restricted
    to it is exact; only the normaliser needs the whole row (ties at the k-th value beyond the list)."""
    # [B, k], descending. The barrier keeps XLA:TPU's one-pass TopK: seeing only a slice of it used, XLA
    # rewrites it into a sort of the whole row (measured: 10 passes instead of 1 at B = 256).
    vals = jax.lax.optimization_barrier(jax.lax.top_k(s, k))[0]
    m, kth = vals[:, :1], vals[:, -1:]
    z = _masses(s, m, jnp.concatenate([jnp.full_like(kth, -jnp.inf), kth], axis=1), strict=False)
    if top_p >= 1.0:
        return kth, m, z[:, :1]
    probs = jnp.exp(vals - m) / z[:, 1:]
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p  # the sort's test on its first k entries
    return jnp.min(jnp.where(keep, vals, jnp.inf), axis=-1, keepdims=True), m, z[:, :1]


def _key(f: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negatives flipped, positives above them)."""
    u = jax.lax.bitcast_convert_type(f, jnp.uint32)
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _unkey(k: jax.Array) -> jax.Array:
    u = jnp.where(k >> 31 == 1, k & jnp.uint32(0x7FFFFFFF), ~k)
    return jax.lax.bitcast_convert_type(u, jnp.float32)


def _search_cutoff(s: jax.Array, top_p: float) -> jax.Array:
    """Top-p cutoff [B, 1] of float32 s [B, V] by an exact search over the float's bits, no sort.

    The cutoff is the largest value c with mass(s >= c) >= top_p (the same value the sorted cumsum picks,
    ties included). Search its order-preserving uint32 key in [key(min), key(max) + 1): each pass measures
    the mass at 15 thresholds and keeps the sub-interval where the test flips; 8 passes reach one key."""
    lo_v, m = jnp.min(s, axis=-1, keepdims=True), jnp.max(s, axis=-1, keepdims=True)
    z = _masses(s, m, jnp.full_like(m, -jnp.inf), strict=False)
    need = top_p * z  # [B, 1]
    j = jnp.arange(1, _WAYS, dtype=jnp.uint32)

    def body(_, c):
        lo, hi = c  # [B, 1] uint32: the test holds at lo and fails at hi
        w = hi - lo
        step = w // _WAYS + (w % _WAYS != 0).astype(jnp.uint32)  # ceil(w / 16): j * step fits in uint32
        t = lo + jnp.minimum(j * step, w)  # [B, 15], ascending, in (lo, hi]
        n = jnp.sum(_masses(s, m, _unkey(t), strict=False) >= need, axis=-1, keepdims=True)  # a prefix holds
        new_lo = jnp.where(n > 0, jnp.take_along_axis(t, jnp.maximum(n - 1, 0), axis=-1), lo)
        new_hi = jnp.where(n < _WAYS - 1, jnp.take_along_axis(t, jnp.minimum(n, _WAYS - 2), axis=-1), hi)
        return new_lo, new_hi

    lo, _ = jax.lax.fori_loop(0, math.ceil(32 / math.log2(_WAYS)), body, (_key(lo_v), _key(m) + 1))
    return _unkey(lo)


def _cutoff(s: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """The smallest kept value per row [B, 1]: s >= cutoff is the kept set."""
    if 0 < top_k < s.shape[-1]:
        return _topk_cutoff(s, top_k, top_p)[0]
    if top_p < 1.0:
        return _search_cutoff(s, top_p)
    return jnp.full((s.shape[0], 1), -jnp.inf, s.dtype)


def kept_mask(scaled: jax.Array, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """bool [B, V]: the tokens sampling may draw from scaled logits [B, V] (logits / temperature).

    top-k keeps every token >= the k-th largest value (its ties too), then top-p keeps every token >= the
    cutoff: the smallest value whose renormalised mass strictly above it is < top_p (its ties too). Exactly
    the sorted cumsum's set, computed without a sort; tokens at -inf are never kept."""
    return (scaled >= _cutoff(scaled, top_k, top_p)) & (scaled > -jnp.inf)


def _num_candidates(top_p: float, batch: int) -> int:
    """Gumbel candidates per row: the top J of logits + noise are J draws without replacement, each kept
    with probability >= top_p, so a row misses with probability <= (1 - top_p) ** J."""
    j = 16
    while j < _MAX_CANDIDATES and batch * (1.0 - top_p) ** j > _MISS_RATE:
        j *= 2
    return j


def _picked(s: jax.Array, tok: jax.Array) -> jax.Array:
    """s at each row's token [B]: a gather, not a pass over the vocabulary."""
    return jnp.take_along_axis(s, tok[:, None], axis=-1)[:, 0]


def sample_tokens(logits: jax.Array, keys: jax.Array, sp: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row from float32 logits [B, V]; returns (tokens [B] int32, log-probs [B] float32).

    Log-probs are under softmax(logits / temperature) before truncation. Tokens are those of
    jax.vmap(jax.random.categorical)(keys, masked), masked = logits / temperature with the tokens outside
    kept_mask at -inf (greedy at temperature 0)."""
    if sp.temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return tok, _picked(logits, tok) - jax.nn.logsumexp(logits, axis=-1)
    s = logits / sp.temperature
    if 0 < sp.top_k < s.shape[-1]:
        cutoff, m, z = _topk_cutoff(s, sp.top_k, sp.top_p)
        tok = jax.vmap(jax.random.categorical)(keys, jnp.where(s < cutoff, -jnp.inf, s)).astype(jnp.int32)
        return tok, _picked(s, tok) - (m[:, 0] + jnp.log(z[:, 0]))
    if sp.top_p >= 1.0:
        tok = jax.vmap(jax.random.categorical)(keys, s).astype(jnp.int32)
        return tok, _picked(s, tok) - jax.nn.logsumexp(s, axis=-1)
    return _sample_top_p(s, keys, sp.top_p)


def _sample_top_p(s: jax.Array, keys: jax.Array, top_p: float) -> tuple[jax.Array, jax.Array]:
    """Top-p alone: categorical(masked) is the first of the top-J of s + noise that top-p keeps."""
    J = min(_num_candidates(top_p, s.shape[0]), s.shape[-1])  # J = V: the top token is kept, no fallback
    _, cand = jax.lax.top_k(_gumbel(keys, s) + s, J)  # categorical's own order (ties: lower index first)
    cv = jnp.take_along_axis(s, cand, axis=-1)  # [B, J]
    # The row max is at most the noise's range (< 40) above the first candidate: exp(s - r) cannot overflow.
    r = jnp.max(cv, axis=-1, keepdims=True)
    mass = _masses(s, r, jnp.concatenate([jnp.full_like(r, -jnp.inf), cv], axis=1), strict=True)
    z, above = mass[:, :1], mass[:, 1:]
    kept = above < top_p * z  # the sort keeps a value iff the mass strictly above it is < top_p
    found = jnp.any(kept, axis=-1)
    first = jnp.argmax(kept, axis=-1)[:, None]
    tok = jnp.take_along_axis(cand, first, axis=-1)[:, 0].astype(jnp.int32)
    picked = jnp.take_along_axis(cv, first, axis=-1)[:, 0]
    lse = r[:, 0] + jnp.log(z[:, 0])

    def exact(_):
        cutoff = _search_cutoff(s, top_p)
        t = jax.vmap(jax.random.categorical)(keys, jnp.where(s < cutoff, -jnp.inf, s)).astype(jnp.int32)
        return jnp.where(found, tok, t), jnp.where(found, picked, _picked(s, t))

    tok, picked = jax.lax.cond(jnp.all(found), lambda _: (tok, picked), exact, None)
    return tok, picked - lse


def row_keys(key: jax.Array, row_id: jax.Array, step) -> jax.Array:
    """A key per row from (row id, token index): a row's sample depends on neither its batch mates nor when it
    ran (compaction, refill, preemption). step is a scalar or one index per row."""
    step = jnp.broadcast_to(step, row_id.shape)
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(key, r), t))(row_id, step)
