"""GRPO policy loss: PPO clipped surrogate with dual clip, optional KL anchor and entropy bonus.

Everything is jit-friendly: options are static Python values, data never drives Python control flow.
Shapes: logp, old_logp, sampler_logp, ref_logp, entropy, mask are [N, T] (mask is 1 on completion tokens);
advantages is [N] (broadcast over tokens) or [N, T]; row_weight is [N], nonzero for real rows and 0
for padding rows that must not count anywhere.

The loss of a batch is numerator / denominator where the numerator is a sum of per-row terms and the
denominator depends only on the masks. Summing both over micro-batches therefore reproduces the
full-batch loss exactly (see policy_loss_terms).
"""
from __future__ import annotations

from typing import Mapping

import jax
import jax.numpy as jnp

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k3")

# verl clamps log-ratios before exponentiating so a stale or garbage log-prob cannot overflow.
_LOG_RATIO_CLAMP = 20.0
_K3_CLAMP = 10.0

Array = jax.Array


def token_logprobs(logits: Array, targets: Array) -> Array:
    """log p(targets) under logits: [N, T, V], [N, T] int -> [N, T] float32."""
    if logits.ndim != targets.ndim + 1 or logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} must be targets {targets.shape} plus a vocab axis")
    x = logits.astype(jnp.float32)
    # x[target] - logsumexp(x): the [N, T, V] log-softmax itself is never materialised.
    picked = jnp.take_along_axis(x, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(x, axis=-1)


def token_entropy(logits: Array) -> Array:
    """Entropy of the next-token distribution: [N, T, V] -> [N, T] float32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    p = jnp.exp(logp)
    # Vocab entries with -inf logits have p = 0 and contribute 0 (not 0 * -inf = nan).
    plogp = jnp.where(p > 0, p * logp, 0.0)
    return -jnp.sum(plogp, axis=-1)


def head_logprobs(head, h: Array, targets: Array, *, entropy: bool = False,
                  chunk: int | None = None) -> tuple[Array, Array | None]:
    """log p(targets) [N, W] (and the entropy [N, W] if asked) from hidden states h [N, W, D], with
    head(x) -> logits [..., V] (final norm + LM head).

    With chunk < W the positions are taken `chunk` at a time and each chunk's logits are recomputed in
    the backward pass, so at most [N, chunk, V] logits are live (a 151,936-token vocabulary over
    thousands of completion positions would not fit otherwise); the values are the same.
    """
    N, W = targets.shape

    def one(hc, tc):
        logits = head(hc)
        return token_logprobs(logits, tc), (token_entropy(logits) if entropy else None)

    if not chunk or chunk >= W:
        return one(h, targets)
    n = -(-W // chunk)
    pad = n * chunk - W
    hs = jnp.pad(h, ((0, 0), (0, pad), (0, 0))).reshape(N, n, chunk, h.shape[-1]).swapaxes(0, 1)
    ts = jnp.pad(targets, ((0, 0), (0, pad))).reshape(N, n, chunk).swapaxes(0, 1)
    lp, ent = jax.lax.map(lambda x: jax.checkpoint(one)(*x), (hs, ts))
    back = lambda a: a.swapaxes(0, 1).reshape(N, n * chunk)[:, :W]
    return back(lp), (back(ent) if entropy else None)


def kl_penalty(logp: Array, ref_logp: Array, estimator: str = "k3") -> Array:
    """Per-token KL(pi || ref) estimate from sampled-token log-probs.

    k1: logp - ref_logp. k3 (verl "low_var_kl"): exp(ref - logp) - (ref - logp) - 1, clamped to [-10, 10].
    """
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = jnp.clip(ref_logp - logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return jnp.clip(jnp.exp(d) - d - 1.0, -_K3_CLAMP, _K3_CLAMP)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def _check_options(
    agg: str, dual_clip: float | None, clip_low: float, clip_high: float, kl_estimator: str,
    tis_cap: float = 0.0, sampler_logp=None,
) -> None:
    if not tis_cap >= 0:
        raise ValueError(f"tis_cap must be >= 0 (0 = off), got {tis_cap}")
    if tis_cap and sampler_logp is None:
        raise ValueError("tis_cap weights tokens by the trainer-to-sampler ratio: pass sampler_logp")
    if kl_estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {kl_estimator!r}")
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (or None to disable), got {dual_clip}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")


def _effective_mask(mask: Array, row_weight: Array | None) -> Array:
    """Token mask with padding rows zeroed, float32 [N, T]."""
    if mask.ndim != 2:
        raise ValueError(f"mask must be [N, T], got shape {mask.shape}")
    m = (mask > 0).astype(jnp.float32)
    if row_weight is not None:
        if row_weight.shape != mask.shape[:1]:
            raise ValueError(f"row_weight must be [N]={mask.shape[:1]}, got {row_weight.shape}")
        m = m * (row_weight > 0).astype(jnp.float32)[:, None]
    return m


def policy_loss_denominator(
    mask: Array,
    *,
    agg: str = "seq-mean-token-mean",
    row_weight: Array | None = None,
) -> Array:
    """The denominator of the loss of these rows; depends only on masks (known before any forward).

    token-mean: number of masked tokens; seq-mean-token-mean: number of real rows with >= 1 token;
    seq-mean-token-sum-norm: number of real rows.
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    m = _effective_mask(mask, row_weight)
    if agg == "token-mean":
        return jnp.sum(m)
    if agg == "seq-mean-token-mean":
        return jnp.sum((jnp.sum(m, axis=-1) > 0).astype(jnp.float32))
    rows = jnp.ones(mask.shape[:1], jnp.float32) if row_weight is None else (row_weight > 0)
    return jnp.sum(rows.astype(jnp.float32))


def _agg_numerator(x: Array, m: Array, agg: str, max_len_norm: float | None) -> Array:
    """Sum over rows of each row's contribution to agg(x); x and m are [N, T]."""
    xm = jnp.where(m > 0, x, 0.0)
    if agg == "token-mean":
        return jnp.sum(xm)
    row_sum = jnp.sum(xm, axis=-1)
    if agg == "seq-mean-token-mean":
        return jnp.sum(row_sum / jnp.maximum(jnp.sum(m, axis=-1), 1.0))
    norm = float(x.shape[-1] if max_len_norm is None else max_len_norm)
    if not norm > 0:
        raise ValueError(f"max_len_norm must be positive, got {max_len_norm}")
    return jnp.sum(row_sum) / norm


def _token_terms(
    logp, old_logp, advantages, m, *, clip_low, clip_high, dual_clip, ref_logp, kl_estimator, entropy,
    sampler_logp=None, tis_cap=0.0,
) -> dict[str, Array]:
    """Per-token quantities [N, T]; inputs at masked-out positions are replaced by safe values."""
    f32 = lambda a: a.astype(jnp.float32)
    on = m > 0
    logp = jnp.where(on, f32(logp), 0.0)
    old_logp = jnp.where(on, f32(old_logp), 0.0)
    adv = f32(advantages)
    if adv.ndim == 1:
        adv = adv[:, None]
    adv = jnp.broadcast_to(adv, m.shape)

    log_ratio = jnp.clip(logp - old_logp, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = jnp.exp(log_ratio)
    pg1 = -adv * ratio
    pg2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = jnp.maximum(pg1, pg2)
    is_clip = pg2 > pg1
    if dual_clip is None:
        pg = clipped
        is_dual = jnp.zeros_like(is_clip)
    else:
        pg3 = -adv * dual_clip
        pg = jnp.where(adv < 0, jnp.minimum(clipped, pg3), clipped)
        is_dual = (adv < 0) & (clipped > pg3)
    out = {
        "ratio": ratio,
        "approx_kl": old_logp - logp,  # k1 estimate of KL(old || new) on tokens sampled from old
        "clip": is_clip,
        "clip_high": is_clip & (ratio > 1.0 + clip_high),
        "clip_low": is_clip & (ratio < 1.0 - clip_low),
        "dual_clip": is_dual,
    }
    if sampler_logp is not None:
        # The trainer's log-probs (these parameters, no gradient) against the sampler's for the same tokens:
        # log r with r = p_trainer / p_sampler. k3 = r - 1 - log r estimates KL(sampler || trainer) without
        # bias on tokens the sampler drew.
        trainer, sampler = jax.lax.stop_gradient(logp), jnp.where(on, f32(sampler_logp), 0.0)
        out["logp_gap_abs"] = jnp.abs(trainer - sampler)
        out["logp_gap_k3"] = kl_penalty(sampler, trainer, "k3")
        if tis_cap:  # truncated importance sampling: the pg term weighted by min(r, C), no gradient through it
            r = jnp.exp(jnp.clip(trainer - sampler, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
            pg = pg * jnp.minimum(r, tis_cap)
            out["tis_capped"] = r > tis_cap
    out["pg"] = pg
    if ref_logp is not None:
        out["kl"] = kl_penalty(logp, jnp.where(on, f32(ref_logp), 0.0), kl_estimator)
    if entropy is not None:
        out["entropy"] = jnp.where(on, f32(entropy), 0.0)
    return out


def _is_zero(c) -> bool:
    """True for a Python zero coefficient (an array coefficient, e.g. per slot under vmap, counts as used)."""
    return isinstance(c, (int, float)) and c == 0


def _prepare(logp, old_logp, advantages, mask, row_weight, ref_logp, entropy, kl_coef, entropy_coef,
             sampler_logp=None):
    for name, a in (("logp", logp), ("old_logp", old_logp), ("ref_logp", ref_logp), ("entropy", entropy),
                    ("sampler_logp", sampler_logp)):
        if a is not None and a.shape != mask.shape:
            raise ValueError(f"{name} must have the mask's shape {mask.shape}, got {a.shape}")
    if advantages.shape not in (mask.shape[:1], mask.shape):
        raise ValueError(f"advantages must be [N] or [N, T] for mask {mask.shape}, got {advantages.shape}")
    if not _is_zero(kl_coef) and ref_logp is None:
        raise ValueError("kl_coef is nonzero but ref_logp is None; pass the reference log-probs")
    if not _is_zero(entropy_coef) and entropy is None:
        raise ValueError("entropy_coef is nonzero but entropy is None; pass token_entropy(logits)")
    return _effective_mask(mask, row_weight)


def policy_loss_terms(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean-token-mean",
    max_len_norm: float | None = None,
    ref_logp: Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Array | None = None,
    entropy_coef: float = 0.0,
    row_weight: Array | None = None,
    sampler_logp: Array | None = None,
    tis_cap: float = 0.0,
) -> tuple[Array, Array]:
    """(numerator, denominator) of the loss; loss = numerator / denominator.

    The numerator is a sum of per-row terms and the denominator a count of rows or tokens, so summing
    both over micro-batches of one batch gives exactly that batch's loss. The per-token loss is
    w * pg + kl_coef * kl - entropy_coef * entropy, aggregated by agg. With seq-mean-token-sum-norm give
    max_len_norm explicitly if micro-batches differ in T (the default is each call's T).
    kl_coef / entropy_coef may be Python floats (0 drops the term) or arrays (e.g. one per slot).
    w = 1, or with tis_cap = C > 0 truncated importance sampling (verl's tis_imp_ratio_cap, TRL's
    vllm_importance_sampling_cap): w = min(exp(logp - sampler_logp), C) with no gradient through it, logp
    being the trainer's log-probs under the parameters that sampled (pair it with old_logp = logp, no
    gradient: the ratio then corrects only what the sampler computed differently).
    """
    _check_options(agg, dual_clip, clip_low, clip_high, kl_estimator, tis_cap, sampler_logp)
    m = _prepare(logp, old_logp, advantages, mask, row_weight, ref_logp, entropy, kl_coef, entropy_coef,
                 sampler_logp)
    use_kl, use_ent = not _is_zero(kl_coef), not _is_zero(entropy_coef)
    t = _token_terms(
        logp, old_logp, advantages, m, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        ref_logp=ref_logp if use_kl else None, kl_estimator=kl_estimator,
        entropy=entropy if use_ent else None, sampler_logp=sampler_logp if tis_cap else None, tis_cap=tis_cap,
    )
    tok = t["pg"]
    if use_kl:
        tok = tok + kl_coef * t["kl"]
    if use_ent:
        tok = tok - entropy_coef * t["entropy"]
    num = _agg_numerator(tok, m, agg, max_len_norm)
    return num, policy_loss_denominator(mask, agg=agg, row_weight=row_weight)


def policy_loss_stats(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean-token-mean",
    max_len_norm: float | None = None,
    ref_logp: Array | None = None,
    kl_estimator: str = "k3",
    entropy: Array | None = None,
    row_weight: Array | None = None,
    sampler_logp: Array | None = None,
    tis_cap: float = 0.0,
) -> dict[str, Array]:
    """Additive statistics behind the metrics, so micro-batches combine exactly (combine_stats).

    Keys: tokens (masked token count), loss_den and pg_num (agg numerator of the pg term), and masked
    token sums clip, clip_low, clip_high, dual_clip, approx_kl, ratio (+ kl, entropy when given; with
    sampler_logp logp_gap_abs, |logp - sampler_logp|, and logp_gap_k3, r - 1 - log r for
    r = exp(logp - sampler_logp); with tis_cap also tis_capped, the tokens whose weight the cap cut);
    ratio_max is a max, not a sum.
    """
    _check_options(agg, dual_clip, clip_low, clip_high, kl_estimator, tis_cap, sampler_logp)
    m = _prepare(logp, old_logp, advantages, mask, row_weight, ref_logp, entropy, 0.0, 0.0, sampler_logp)
    t = _token_terms(
        logp, old_logp, advantages, m, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        ref_logp=ref_logp, kl_estimator=kl_estimator, entropy=entropy, sampler_logp=sampler_logp, tis_cap=tis_cap,
    )
    msum = lambda x: jnp.sum(jnp.where(m > 0, x.astype(jnp.float32), 0.0))
    stats = {
        "tokens": jnp.sum(m),
        "loss_den": policy_loss_denominator(mask, agg=agg, row_weight=row_weight),
        "pg_num": _agg_numerator(t["pg"], m, agg, max_len_norm),
        "ratio_max": jnp.max(jnp.where(m > 0, t["ratio"], -jnp.inf)),
    }
    for k in ("clip", "clip_low", "clip_high", "dual_clip", "approx_kl", "ratio", "kl", "entropy", "logp_gap_abs",
              "logp_gap_k3", "tis_capped"):
        if k in t:
            stats[k] = msum(t[k])
    return stats


def combine_stats(a: Mapping[str, Array], b: Mapping[str, Array]) -> dict[str, Array]:
    """Merge the stats of two micro-batches: sums add, *_max keys take the max."""
    if set(a) != set(b):
        raise ValueError(f"stats keys differ: {sorted(set(a) ^ set(b))}")
    return {k: (jnp.maximum(a[k], b[k]) if k.endswith("_max") else a[k] + b[k]) for k in a}


def finalize_stats(stats: Mapping[str, Array]) -> dict[str, Array]:
    """Metrics from (combined) stats: pg_loss in the loss's aggregation, the rest masked token means.

    clip_frac counts tokens whose clipped branch is active (pg2 > pg1); clip_frac_high/low split it by
    side; dual_clip_frac counts A < 0 tokens capped by the dual clip; approx_kl is mean(old - new);
    logp_gap_mean_abs and logp_gap_k3 the token means of the trainer-sampler gap; tis_capped_frac the tokens
    whose importance weight the cap cut.
    """
    tokens = jnp.maximum(stats["tokens"], 1.0)
    out = {
        "pg_loss": stats["pg_num"] / jnp.maximum(stats["loss_den"], 1.0),
        "clip_frac": stats["clip"] / tokens,
        "clip_frac_low": stats["clip_low"] / tokens,
        "clip_frac_high": stats["clip_high"] / tokens,
        "dual_clip_frac": stats["dual_clip"] / tokens,
        "approx_kl": stats["approx_kl"] / tokens,
        "ratio_mean": stats["ratio"] / tokens,
        # No masked token at all: report 0 rather than -inf.
        "ratio_max": jnp.where(stats["tokens"] > 0, stats["ratio_max"], 0.0),
        "num_tokens": stats["tokens"],
    }
    for k, name in (("kl", "kl"), ("entropy", "entropy"), ("logp_gap_abs", "logp_gap_mean_abs"),
                    ("logp_gap_k3", "logp_gap_k3"), ("tis_capped", "tis_capped_frac")):
        if k in stats:
            out[name] = stats[k] / tokens
    return out


def policy_loss(
    logp: Array,
    old_logp: Array,
    advantages: Array,
    mask: Array,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = 3.0,
    agg: str = "seq-mean-token-mean",
    max_len_norm: float | None = None,
    ref_logp: Array | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    entropy: Array | None = None,
    entropy_coef: float = 0.0,
    row_weight: Array | None = None,
    sampler_logp: Array | None = None,
    tis_cap: float = 0.0,
) -> tuple[Array, dict[str, Array]]:
    """GRPO loss (scalar) and metrics; see policy_loss_terms and finalize_stats.

    The loss is 0 when no row has a masked token. Metrics carry no gradient.
    """
    num, den = policy_loss_terms(
        logp, old_logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip,
        agg=agg, max_len_norm=max_len_norm, ref_logp=ref_logp, kl_coef=kl_coef,
        kl_estimator=kl_estimator, entropy=entropy, entropy_coef=entropy_coef, row_weight=row_weight,
        sampler_logp=sampler_logp, tis_cap=tis_cap,
    )
    loss = num / jnp.maximum(den, 1.0)
    sg = jax.lax.stop_gradient
    stats = policy_loss_stats(
        sg(logp), sg(old_logp), sg(advantages), mask, clip_low=clip_low, clip_high=clip_high,
        dual_clip=dual_clip, agg=agg, max_len_norm=max_len_norm,
        ref_logp=None if ref_logp is None else sg(ref_logp), kl_estimator=kl_estimator,
        entropy=None if entropy is None else sg(entropy), row_weight=row_weight,
        sampler_logp=None if sampler_logp is None else sg(sampler_logp), tis_cap=tis_cap,
    )
    return loss, finalize_stats(stats)
