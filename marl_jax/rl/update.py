"""The GRPO update: per-slot losses, one work item at a time, exact per-group gradients.

A step (the function make_train_step returns) takes a TrainBatch ([S, R, T], see marl_jax.rl.batch) and:
  1. lays it out into work items on the host (marl_jax.rl.layout): rows of one slot (and, with diagnostics,
     of one diagnostic group), micro_batch of them or as many as a token budget holds, each over a token
     window just long enough for its longest row or packed end to end (layout.Window, layout.Packed);
  2. runs `item_grad` on each item: a forward pass on the item's slot's parameters gives every row's loss
     numerator, one VJP (cotangent = row weight / the slot's denominator) the slot's gradient from these rows;
     the loss is a sum of per-row terms over a denominator fixed for the whole batch, so the items' gradients
     add up exactly (`accumulate`), each into its group's accumulator: exact per-group gradients for the price
     of one backward pass;
  3. `finish`: sums the group gradients per slot into the slot gradient (exactly the gradient of the slot's
     loss, so under Shared-Policy the per-role gradients add up to it by construction), measures per-role
     norms, projection shares, cosines and copy alignment, applies the levers, and clips and applies AdamW
     per slot (optim.per_slot), unless the loss or any gradient is not finite: then the update is skipped and
     counted, and parameters stay as they were.

item_grad, accumulate and finish are pure functions of arrays; the step jits each and runs them from a short
host loop. An RL batch's rows, padded length and packed shapes change nearly every step, so a program over the
whole batch would compile again each time; an item's program depends only on its own shape (window or packed
shape, rows, completion window), so a run stops compiling after its first steps. Under a mesh every item's rows
are placed over the data axes and each program's outputs keep the shardings of what they stand for (a slot's
gradient like its weights, the new state like the old), so nothing is gathered.

Each slot's loss is normalised by its own rows, so an Isolated-Policy slot's step does not depend on how many
rows other roles had: the reference's separate per-role updates.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig
from marl_jax.policy.lora import PolicySpec, unstacked
from marl_jax.rl import layout
from marl_jax.rl import loss as L
from marl_jax.rl.batch import TrainBatch
from marl_jax.rl.optim import global_norm_per_slot
# The memory model remat="auto" reads (marl_jax.rl.memory), importable from here as well.
from marl_jax.rl.memory import remat_for  # noqa: F401
# The host-side layout (marl_jax.rl.layout), importable from here as well.
from marl_jax.rl.layout import (Packed, Window, item_positions, item_windows, length_ladder, pack_batch,  # noqa: F401
                                pack_rows, pack_shapes, pack_units, share_units)


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = 3.0
    agg: str = "seq-mean-token-mean"
    max_len_norm: float | None = None
    kl: bool = False  # any role has a KL coefficient (needs a reference forward pass)
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    old_logp: str = "sampler"  # "sampler" | "recompute"
    micro_batch: int = 8
    diagnostics: bool = True
    metrics: bool = True  # per-role clip fraction / KL / entropy (needs token entropies)
    remat: str = "full"  # what the backward pass recomputes: none | dots | full (see decoder.forward) | auto
    remat_budget_gb: float = 4.0  # remat="auto": activation bytes one item may hold (per token window)
    dtype: Any = jnp.float32  # compute dtype of the base model; adapters, gradients and optimizer stay float32
    length_buckets: int = 4  # token windows from T/n to T (see length_ladder); 1 runs every item over all T
    length_grid: int = 2  # window sizes per octave (length_ladder): finer, less padding, more item programs
    head_chunk: int = 0  # LM-head positions per chunk (0: chunk only when one item's logits exceed 256 MiB)
    unroll: bool = False  # the layers as straight-line code, not a loop (decoder.Decoder.unroll): 2x compile
    # Sequence packing: the rows of a micro-batch are laid end to end in fewer sequences of the batch's length
    # (segment ids, per-row positions, attention within a row only), as few as hold them (layout.pack_shapes).
    # Values are unchanged (tests/test_update_layout.py).
    packing: bool = False
    # With packing: rows of a micro-batch whose tokens start with the same share_prefix or more tokens (a
    # task's episodes, a role's instructions) are laid over one copy of that prefix, computed once; their
    # gradients through it add up as they would over separate copies. 0: off.
    share_prefix: int = 0
    # Token-budget micro-batches (verl's use_dynamic_bsz / ppo_max_token_len_per_gpu): each micro-batch holds
    # as many rows of one slot (and diagnostic group) as this many computed positions allow (rows x window,
    # or packed sequences x window), not micro_batch rows: one long row alone, many short rows together.
    # Row counts, sequence counts and windows sit on the length grid (layout.budget_items). 0: off, micro_batch
    # rows each.
    max_tokens_per_micro_batch: int = 0
    # Truncated importance sampling (verl's tis_imp_ratio_cap, TRL's vllm_importance_sampling_cap): each
    # token's policy-gradient term is weighted by min(exp(trainer logp - sampler logp), tis_cap), the
    # trainer's log-prob under the parameters that sampled (no gradient). 0: off. Needs old_logp="recompute".
    tis_cap: float = 0.0
    # The sampling temperature: log-probs (and entropies, and the reference's) under softmax(logits /
    # temperature), the distribution the rollouts were drawn from and the sampler's log-probs are under, as
    # verl's actor and TRL's GRPOTrainer score them. At 1.0 they would differ from the sampler's by the
    # temperature alone (docs/levers.md#sampler-and-trainer-log-probs).
    temperature: float = 1.0

    def __post_init__(self):
        if self.old_logp not in ("sampler", "recompute"):
            raise ValueError(f"old_logp must be 'sampler' or 'recompute', got {self.old_logp!r}")
        if self.agg not in L.AGG_MODES:
            raise ValueError(f"agg must be one of {L.AGG_MODES}, got {self.agg!r}")
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (the sampling temperature; 1.0 for greedy rollouts), "
                             f"got {self.temperature}")
        if self.remat not in REMAT_MODES:
            raise ValueError(f"remat must be one of {REMAT_MODES}, got {self.remat!r}")
        if self.remat == "auto" and not self.remat_budget_gb > 0:
            raise ValueError(f"remat='auto' needs remat_budget_gb > 0, got {self.remat_budget_gb}")
        if self.length_grid < 1:
            raise ValueError(f"length_grid must be >= 1 (window sizes per octave), got {self.length_grid}")
        if self.length_buckets < 1:
            raise ValueError(f"length_buckets must be >= 1, got {self.length_buckets}")
        if self.share_prefix < 0:
            raise ValueError(f"share_prefix must be >= 0 (0 = off), got {self.share_prefix}")
        if self.share_prefix and not self.packing:
            raise ValueError("share_prefix lays rows over a shared prefix in packed sequences: it needs packing=True")
        if self.head_chunk < 0:
            raise ValueError(f"head_chunk must be >= 0 (0 = automatic), got {self.head_chunk}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError("max_tokens_per_micro_batch must be >= 0 (0 = off: micro_batch rows per "
                             f"micro-batch), got {self.max_tokens_per_micro_batch}")
        if self.tis_cap < 0:
            raise ValueError(f"tis_cap must be >= 0 (0 = off), got {self.tis_cap}")
        if self.tis_cap and self.old_logp != "recompute":
            raise ValueError("tis_cap weights the PPO ratio against the trainer's own old log-probs by the "
                             "trainer-to-sampler ratio: it needs old_logp='recompute' (with 'sampler' the ratio "
                             "already divides by the sampler's log-probs)")


REMAT_MODES = ("none", "dots", "full", "auto")


_HEAD_BYTES = 256 * 2 ** 20  # one item's float32 logits above this are computed in chunks of positions


def head_chunk(N: int, W: int, V: int, chunk: int = 0, *, sharded: bool = False) -> tuple[int, bool]:
    """The LM head's chunk for an item of N rows scoring W positions each over a V-token vocabulary, as
    (positions per chunk, flat): chunk > 0 (UpdateConfig.head_chunk) is taken per row; otherwise the whole
    window when its float32 logits fit _HEAD_BYTES, else the positions of all rows laid as one (flat) in
    chunks whose logits fit it: a long row and a micro-batch of many short ones alike. Under a mesh the
    rows stay split over the data axes (not flat) and each row's positions are chunked."""
    if chunk:
        return chunk, False
    if N * W * V * 4 <= _HEAD_BYTES:
        return W, False
    if not sharded:
        return max(1, _HEAD_BYTES // (4 * V)), True
    return max(8, _HEAD_BYTES // (4 * V * N)), False


def scored_positions(loss_mask: np.ndarray, capacity: int) -> np.ndarray | None:
    """The flat indices (row * W + position) of an item's scored positions, padded with N * W to `capacity`
    entries: the LM head then runs over them alone instead of every row's whole window. A packed item's
    capacity is its packed positions, which hold every completion token, so its program's shape is still
    its packed shape. None when that saves nothing (or, which packing rules out, they do not fit)."""
    N, W = loss_mask.shape
    idx = np.flatnonzero(np.asarray(loss_mask) > 0).astype(np.int32)
    if capacity >= N * W or len(idx) > capacity:
        return None
    out = np.full(capacity, N * W, np.int32)
    out[:len(idx)] = idx
    return out


class TrainState(NamedTuple):
    trainable: Any  # slot-stacked
    opt_state: Any
    step: jax.Array
    skipped: jax.Array  # updates skipped for non-finite loss / gradients
    grad_ema: Any = None  # [K, ...] EMA of each role's past gradient (levers.damping; None when off)


class Tables(NamedTuple):
    """The workflow's static tables (host tuples): each diagnostic group's slot and role, each role's slot."""

    group_slot: tuple[int, ...]
    group_role: tuple[int, ...]
    role_slot: tuple[int, ...]


class ItemRows(NamedTuple):
    """The rows of one work item, all of one slot ([n, ...] each): what item_grad reads. Padding rows have
    weight 0 and group -1. Tokens are cut to the item's window; targets and masks span the batch's W."""

    tokens: Any  # [n, t] int32: prompt + completion, right-padded
    valid: Any  # [n, t] bool: real tokens
    win_start: Any  # [n] int32: the position predicting the first completion token
    targets: Any  # [n, W] int32: completion tokens
    loss_mask: Any  # [n, W] float32: 1 on real completion tokens
    old_logp: Any  # [n, W] float32: their log-probs under the sampler
    advantages: Any  # [n] float32
    kl_coef: Any  # [n] float32: the row's role's KL coefficient
    weight: Any = None  # [n] float32: 1 real row, 0 padding
    group: Any = None  # [n] int32: diagnostic group, -1 padding
    length: Any = None  # [n] int32: tokens per row (packed items read it)
    pack_seq: Any = None  # [n] packed items: the sequence a row is laid in (layout.RowPacking)
    pack_off: Any = None  # [n] its offset there
    pack_pre: Any = None  # [n] shared prefixes: where the row's prefix copy starts
    pack_share: Any = None  # [n] how many of its first tokens are read from that copy
    head_idx: Any = None  # [c] the flat scored positions the LM head runs over (scored_positions), or None


class RowAux(NamedTuple):
    """Token values of an item's rows ([n, W], no gradient): what the loss statistics read."""

    logp: Any  # the trainer's log-probs under the current parameters
    old: Any  # the PPO ratio's old log-probs: the sampler's, or logp itself (old_logp="recompute")
    entropy: Any = None
    ref: Any = None  # the reference model's log-probs (KL anchor)


class ItemGrad(NamedTuple):
    """What one item gives: its loss numerator (weighted, not yet over the slot's denominator), its slot's
    gradient from its rows, and its rows' additive loss statistics per role ({name: [K]}, or None)."""

    num: jax.Array
    grad: Any
    stats: Any


class Accum(NamedTuple):
    """What a step's items add up to."""

    grads: Any  # [G, ...] one gradient per diagnostic group (diagnostics), else [S, ...] one per slot
    num: jax.Array  # [S] loss numerators
    misaligned: jax.Array  # rows in an item of another group's rows (diagnostics need 0)
    stats: Any  # {name: [K]}: sums over items, maxima for *_max; None without metrics


def pack_item(rows: ItemRows, p: int, t: int):
    """An item's rows laid into p packed sequences of t tokens: (put, segments), put(x) scatters an [n, <=t]
    array of the rows into [p, t]; segments is what decoder.forward takes (ids, or (ids, parents, positions)
    over shared prefixes)."""
    n, tw = rows.tokens.shape  # a row is at most T long; a packed sequence may be longer
    q = jnp.arange(tw)[None]
    live = q < rows.length[:, None]  # [n, tw]
    dst_seq = jnp.where(live, rows.pack_seq[:, None], p)  # padding goes out of bounds: dropped
    dst_pos = rows.pack_off[:, None] + q
    seg = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], (n, tw))
    shared = rows.pack_share is not None
    if shared:
        # A row's first c tokens go to its unit's one prefix copy (every member writes the same values
        # there), segment id n + 1 + its offset; the rest attend to it as their parent.
        c, pre = rows.pack_share[:, None], rows.pack_pre[:, None]
        in_pre = q < c
        dst_pos = jnp.where(in_pre, pre + q, dst_pos)
        prefix_id = jnp.broadcast_to(n + 1 + pre, (n, tw))
    put = lambda x: jnp.zeros((p, t), jnp.int32).at[dst_seq, dst_pos].set(x, mode="drop")
    if not shared:
        return put, put(seg)
    return put, (put(jnp.where(in_pre, prefix_id, seg)), put(jnp.where(in_pre | (c == 0), 0, prefix_id)),
                 put(jnp.broadcast_to(q, (n, tw))))


def completion_logprobs(cfg: ModelConfig, spec: PolicySpec, ucfg: UpdateConfig, params, lora, rows: ItemRows,
                        shape, *, entropy: bool, remat: str, mesh=None, rules=None):
    """The teacher-forced log-probs [n, W] of the rows' completion tokens under params (+ lora), and their
    entropies (or None). shape: the item's layout.Window (rows as they are) or layout.Packed (laid end to end);
    only the scored positions' hidden states reach the LM head."""
    N, W = rows.targets.shape
    idx = jnp.minimum(rows.win_start[:, None] + jnp.arange(W), rows.tokens.shape[1] - 1)
    chunk, flat = head_chunk(N, W, cfg.vocab_size, ucfg.head_chunk, sharded=mesh is not None)
    run = lambda tokens, valid, segments: decoder.forward(
        params, cfg, tokens, valid, lora=lora, lora_scale=spec.scale, dtype=ucfg.dtype, return_hidden=True,
        remat=remat, mesh=mesh, rules=rules, segments=segments, unroll=ucfg.unroll, right_padded=segments is None)
    if isinstance(shape, Packed):
        put, segments = pack_item(rows, shape.p, shape.t)
        h = run(put(rows.tokens), None, segments)
        # each row's scored positions, read back from where its row was laid in the packed sequences
        pos = rows.pack_off[:, None] + idx
        if rows.pack_share is not None:  # positions inside a shared prefix are read from its one copy
            pos = jnp.where(idx < rows.pack_share[:, None], rows.pack_pre[:, None] + idx, pos)
        pos = jnp.minimum(pos, h.shape[1] - 1)
        seq = jnp.broadcast_to(rows.pack_seq[:, None], pos.shape)
        if rows.head_idx is not None:  # only the scored positions' hidden states, not every row's window
            at = jnp.minimum(rows.head_idx, N * W - 1)
            h = h[seq.reshape(-1)[at], pos.reshape(-1)[at]][None]
        else:
            h = h[seq, pos]
    else:  # batch rows: prompt + completion, then padding
        h = jnp.take_along_axis(run(rows.tokens, rows.valid, None), idx[..., None], axis=1)  # [n, W, D]
    head = lambda x: decoder.unembed(params, cfg, x, mesh=mesh, rules=rules)
    if ucfg.temperature != 1.0:  # the distribution the sampler drew from (and scored its log-probs under)
        head = lambda x, plain=head: plain(x).astype(jnp.float32) / ucfg.temperature
    if rows.head_idx is not None:  # the item's scored positions only, laid as one row (scored_positions)
        hi = rows.head_idx
        at = jnp.minimum(hi, N * W - 1)
        c, _ = head_chunk(1, hi.shape[0], cfg.vocab_size)
        lp, ent = L.head_logprobs(head, h, rows.targets.reshape(N * W)[at][None], entropy=entropy, chunk=c)
        back = lambda x: jnp.zeros((N * W,), x.dtype).at[hi].set(x[0], mode="drop").reshape(N, W)
        return back(lp), (None if ent is None else back(ent))
    if flat:  # the item's scored positions as one row: a chunk's logits do not grow with its rows
        lp, ent = L.head_logprobs(head, h.reshape(1, N * W, -1), rows.targets.reshape(1, N * W), entropy=entropy,
                                  chunk=chunk)
        return lp.reshape(N, W), (None if ent is None else ent.reshape(N, W))
    return L.head_logprobs(head, h, rows.targets, entropy=entropy, chunk=chunk)


def row_terms(cfg: ModelConfig, spec: PolicySpec, ucfg: UpdateConfig, base, one_slot, rows: ItemRows, mesh=None,
              rules=None, *, shape=None, norm_len: int | None = None, remat: str | None = None):
    """Per-row loss numerators [n] of one slot's rows, and their RowAux.

    shape: the item's Window or Packed (default: the rows over all their tokens). norm_len: the sequence-sum
    normaliser when ucfg.max_len_norm is unset (the whole batch's W, also when this item scores a shorter
    window). remat: this item's mode (default ucfg.remat). rows may be a mapping of ItemRows' fields."""
    if isinstance(rows, Mapping):
        rows = ItemRows(**rows)
    params, lora = unstacked(spec, base, one_slot)
    shape = shape or Window(rows.tokens.shape[1])
    want_entropy = ucfg.entropy_coef != 0.0 or ucfg.metrics
    score = lambda p, lo, entropy: completion_logprobs(cfg, spec, ucfg, p, lo, rows, shape, entropy=entropy,
                                                       remat=remat or ucfg.remat, mesh=mesh, rules=rules)
    logp, entropy = score(params, lora, want_entropy)
    if entropy is not None and ucfg.entropy_coef == 0.0:
        entropy = jax.lax.stop_gradient(entropy)
    ref = None
    if ucfg.kl:  # the frozen base model is the reference (LoRA off / the initial full weights)
        ref = jax.lax.stop_gradient(score(base, None, False)[0])
    old = jax.lax.stop_gradient(logp) if ucfg.old_logp == "recompute" else rows.old_logp

    def one_row(lp, ol, sl, adv, m, ent, rf, kc):
        num, _ = L.policy_loss_terms(
            lp[None], ol[None], adv[None], m[None], clip_low=ucfg.clip_low, clip_high=ucfg.clip_high,
            dual_clip=ucfg.dual_clip, agg=ucfg.agg, max_len_norm=ucfg.max_len_norm or norm_len or lp.shape[-1],
            ref_logp=None if rf is None else rf[None], kl_coef=kc if ucfg.kl else 0.0,
            kl_estimator=ucfg.kl_estimator, entropy=None if ent is None else ent[None],
            entropy_coef=ucfg.entropy_coef, sampler_logp=sl[None] if ucfg.tis_cap else None, tis_cap=ucfg.tis_cap)
        return num

    opt = lambda x: None if x is None else 0
    nums = jax.vmap(one_row, in_axes=(0, 0, 0, 0, 0, opt(entropy), opt(ref), 0))(
        logp, old, rows.old_logp, rows.advantages, rows.loss_mask, entropy, ref, rows.kl_coef)
    return nums, RowAux(jax.lax.stop_gradient(logp), old,
                        None if entropy is None else jax.lax.stop_gradient(entropy), ref)




def role_stats(ucfg: UpdateConfig, aux: RowAux, rows: ItemRows, group_role, num_roles: int):
    """Additive loss statistics of an item's rows per role ({name: [K]}), the sampler's log-probs against
    the trainer's among them (logp_gap_*)."""
    g_role = jnp.asarray(group_role, jnp.int32)

    def for_role(k):
        in_role = (jnp.take(g_role, jnp.maximum(rows.group, 0)) == k) & (rows.group >= 0)
        rw = rows.weight * in_role
        st = L.policy_loss_stats(
            aux.logp, aux.old, rows.advantages, rows.loss_mask, clip_low=ucfg.clip_low, clip_high=ucfg.clip_high,
            dual_clip=ucfg.dual_clip, agg=ucfg.agg, max_len_norm=ucfg.max_len_norm or rows.targets.shape[1],
            ref_logp=aux.ref, kl_estimator=ucfg.kl_estimator, entropy=aux.entropy, row_weight=rw,
            sampler_logp=rows.old_logp, tis_cap=ucfg.tis_cap)
        st["rows"] = jnp.sum(rw)
        st["resp_tokens"] = jnp.sum(rows.loss_mask * rw[..., None])
        return st
    return jax.vmap(for_role)(jnp.arange(num_roles))


def item_grad(cfg: ModelConfig, spec: PolicySpec, ucfg: UpdateConfig, shape, one_slot, base, rows: ItemRows,
              den, *, group_role, num_roles: int, mesh=None, rules=None) -> ItemGrad:
    """One work item: the rows of one item of one slot in; their loss numerator, that slot's gradient from
    them and their per-role statistics out. den: the slot's loss denominator (over all its rows in the batch),
    so the items' gradients add up to the gradient of the slot's loss. shape: layout.Window or layout.Packed."""
    N, W = rows.targets.shape
    Wt = min(W, shape.t)  # a completion is shorter than its row: later positions are all masked
    scored = rows._replace(targets=rows.targets[:, :Wt], loss_mask=rows.loss_mask[:, :Wt],
                           old_logp=rows.old_logp[:, :Wt])
    remat = ucfg.remat
    if remat == "auto":  # per window: short items keep their activations, long ones recompute
        remat = remat_for(cfg, N, shape.t, Wt, ucfg.remat_budget_gb * 2 ** 30,
                          dtype="bfloat16" if jnp.dtype(ucfg.dtype) == jnp.bfloat16 else "float32",
                          rank=spec.rank if spec.mode == "lora" else 0)
    terms = lambda tr: row_terms(cfg, spec, ucfg, base, tr, scored, mesh, rules, shape=shape, norm_len=W,
                                 remat=remat)
    nums, vjp, aux = jax.vjp(terms, one_slot, has_aux=True)
    (grad,) = vjp((rows.weight / den).astype(nums.dtype))
    stats = None
    if ucfg.metrics:
        aux = jax.tree_util.tree_map(lambda a: jnp.pad(a, ((0, 0), (0, W - Wt))), aux)
        stats = role_stats(ucfg, aux, rows, group_role, num_roles)
    return ItemGrad(jnp.sum(nums * rows.weight), grad, stats)


# ---- adding items up, and the step's end ----

def zero_accum(trainable, stats_like, *, num_groups: int, diagnostics: bool) -> Accum:
    """The accumulators before the first item: zero gradients (one per group with diagnostics, else per slot)
    and sums, maxima below any value; stats_like: an item's stats (or None)."""
    S = jax.tree_util.tree_leaves(trainable)[0].shape[0]
    zeros = lambda lead: jax.tree_util.tree_map(lambda x: jnp.zeros((lead,) + x.shape[1:], x.dtype), trainable)
    stats = None if stats_like is None else {
        k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0, v.dtype) for k, v in stats_like.items()}
    return Accum(zeros(num_groups if diagnostics else S), jnp.zeros((S,), jnp.float32), jnp.int32(0), stats)


def accumulate(acc: Accum, out: ItemGrad, slot, group, misaligned, *, diagnostics: bool) -> Accum:
    """Fold one item into the accumulators: its gradient into its group's (diagnostics; group -1: dropped) or
    its slot's, its numerator into its slot's, its rows of another group, its stats."""
    at = jnp.where(group >= 0, group, jnp.iinfo(jnp.int32).max) if diagnostics else slot
    grads = jax.tree_util.tree_map(lambda a, g: a.at[at].add(g, mode="drop"), acc.grads, out.grad)
    stats = None if out.stats is None else {
        k: jnp.maximum(acc.stats[k], v) if k.endswith("_max") else acc.stats[k] + v for k, v in out.stats.items()}
    return Accum(grads, acc.num.at[slot].add(out.num), acc.misaligned + (misaligned if diagnostics else 0), stats)


def finish(state: TrainState, acc: Accum, den, *, tx, tables: Tables, diagnostics: bool, levers=None):
    """From the accumulated item gradients: per-role diagnostics, levers, clipping and the optimizer. den: [S]
    the slots' loss denominators. Returns (new state, metrics)."""
    S, K = den.shape[0], len(tables.role_slot)
    k_slot = jnp.asarray(tables.role_slot, jnp.int32)
    loss_per_slot = acc.num / den
    metrics = {"loss": jnp.sum(loss_per_slot), "loss_per_slot": loss_per_slot}
    grads, role_g = acc.grads, None
    if diagnostics:  # rows of another group in a micro-batch: the batch was not group-aligned
        metrics["misaligned_rows"] = acc.misaligned
        grads, role_g, diag = _role_diagnostics(acc.grads, jnp.asarray(tables.group_slot, jnp.int32),
                                                jnp.asarray(tables.group_role, jnp.int32), k_slot, S, K)
        metrics.update(diag)
    new_ema = state.grad_ema
    if levers is not None and levers.active:  # damping, fan-out, balancing (marl_jax.rl.levers)
        from marl_jax.rl import levers as LV
        grads, new_ema, metrics["levers"] = LV.apply(levers, role_g, state.grad_ema, k_slot, S)
    metrics["slot_grad_norm"] = global_norm_per_slot(grads)
    if acc.stats is not None:
        metrics["role_stats"] = acc.stats
    finite = jnp.isfinite(metrics["loss"]) & jnp.all(jnp.isfinite(metrics["slot_grad_norm"]))
    metrics["finite"] = finite
    return _apply_if_finite(tx, state, grads, new_ema, finite), metrics


def _tree_dot(a, b):
    return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)).real
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _role_diagnostics(acc, g_slot, g_role, k_slot, S: int, K: int):
    """Per-group gradient accumulators [G, ...] -> (slot gradients [S, ...], role gradients [K, ...], the
    per-role diagnostics: norms, projection shares, cosines, copy alignment, per-group norms)."""
    grads = jax.tree_util.tree_map(lambda x: jax.ops.segment_sum(x, g_slot, num_segments=S), acc)
    role_g = jax.tree_util.tree_map(lambda x: jax.ops.segment_sum(x, g_role, num_segments=K), acc)
    slot_of_role = jax.tree_util.tree_map(lambda x: x[k_slot], grads)  # [K, ...] slot grad of each role
    gram = jax.vmap(lambda a: jax.vmap(lambda b: _tree_dot(a, b))(role_g))(role_g)  # [K, K]
    role_norm = jnp.sqrt(jnp.maximum(jnp.diag(gram), 0.0))
    slot_dot = jax.vmap(_tree_dot)(role_g, slot_of_role)  # <g_k, g_slot(k)>
    slot_sq = jax.vmap(lambda a: _tree_dot(a, a))(slot_of_role)
    same_slot = k_slot[:, None] == k_slot[None, :]
    norm_sum = jnp.sum(jnp.where(same_slot, role_norm[None, :], 0.0), axis=1)
    group_sq = jax.vmap(lambda a: _tree_dot(a, a))(acc)  # [G]
    copies_sq = jax.ops.segment_sum(group_sq, g_role, num_segments=K)
    return grads, role_g, dict(
        role_grad_norm=role_norm,
        role_grad_share=slot_dot / jnp.maximum(slot_sq, 1e-30),
        role_grad_norm_share=role_norm / jnp.maximum(norm_sum, 1e-30),
        role_grad_cos=gram / jnp.maximum(role_norm[:, None] * role_norm[None, :], 1e-30),
        role_copy_alignment=role_norm / jnp.sqrt(jnp.maximum(copies_sq, 1e-30)),
        group_grad_norm=jnp.sqrt(jnp.maximum(group_sq, 0.0)),
    )


def _apply_if_finite(tx, state: "TrainState", grads, new_ema, finite):
    """The optimizer step (clipping and AdamW per slot) when `finite`, else the old state with the skip counted."""
    safe_grads = jax.tree_util.tree_map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_opt = tx.update(safe_grads, state.opt_state, state.trainable)
    new_tr = optax.apply_updates(state.trainable, updates)
    keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)
    return TrainState(keep(new_tr, state.trainable), keep(new_opt, state.opt_state),
                      state.step + 1, state.skipped + (~finite).astype(jnp.int32), keep(new_ema, state.grad_ema))


def item_rows(batch: TrainBatch, it: layout.Item, *, head_on_scored: bool = False) -> ItemRows:
    """An item's rows gathered on the host from its slot's (padding rows, -1, as zeros and group -1). Token
    columns past its window are never read, so they are dropped: its program's shape does not depend on T.
    head_on_scored: a packed item's LM head runs over its completion tokens alone (scored_positions)."""
    s, t = it.slot, min(it.shape.t, batch.tokens.shape[2])
    take = lambda x, fill=0: layout.take_rows(np.asarray(x)[s], it.rows, fill)
    pk = it.pack or layout.RowPacking(None, None)
    rows = ItemRows(tokens=take(batch.tokens[:, :, :t]), valid=take(batch.valid[:, :, :t]),
                    win_start=take(batch.win_start), targets=take(batch.targets), loss_mask=take(batch.loss_mask),
                    old_logp=take(batch.old_logp), advantages=take(batch.advantages), kl_coef=take(batch.kl_coef),
                    weight=take(np.asarray(batch.row_weight, np.float32)), group=take(batch.group, -1),
                    length=None if batch.length is None else take(batch.length),
                    pack_seq=pk.seq, pack_off=pk.off, pack_pre=pk.pre, pack_share=pk.share)
    if isinstance(it.shape, Packed) and head_on_scored:
        W = rows.targets.shape[1]
        rows = rows._replace(head_idx=scored_positions(rows.loss_mask[:, :min(W, it.shape.t)], it.positions))
    return rows


def make_train_step(cfg: ModelConfig, spec: PolicySpec, ucfg: UpdateConfig, tx: optax.GradientTransformation,
                    *, num_groups: int, group_slot, group_role, num_roles: int, role_slot, mesh=None, rules=None,
                    levers=None):
    """The update step: step(state, base, batch) -> (state, metrics), its state donated.

    group_slot[g], group_role[g]: slot and role index of diagnostic group g; role_slot[k]: slot of role k
    (host tuples, static per workflow). With a mesh, the programs' input and output shardings come from the
    logical axis rules (marl_jax.models.sharding): the base and the slot-stacked trainable weights, their
    optimizer state and the gradient accumulators by parameter name (FSDP over "fsdp", tensor parallelism
    over "model"), an item's rows over data x fsdp; metrics are replicated. Nothing is gathered to the host.
    step.item_programs() counts the item programs compiled so far.
    """
    assert len(group_slot) == len(group_role) == num_groups and len(role_slot) == num_roles
    tables = Tables(tuple(group_slot), tuple(group_role), tuple(role_slot))
    budget = ucfg.max_tokens_per_micro_batch
    # Packed items run the LM head over their completion tokens only (scored_positions); under a mesh their
    # rows stay split over the data axes instead.
    head_on_scored = ucfg.packing and mesh is None and not ucfg.head_chunk
    programs = {}  # jitted at the first step: under a mesh their shardings follow the state's shapes

    def compiled(state: TrainState) -> dict:
        if programs:
            return programs
        item = lambda trainable, base, rows, slot, den, *, shape: item_grad(
            cfg, spec, ucfg, shape, jax.tree_util.tree_map(lambda x: x[slot], trainable), base, rows, den,
            group_role=tables.group_role, num_roles=num_roles, mesh=mesh, rules=rules)
        zero = lambda trainable, stats: zero_accum(trainable, stats, num_groups=num_groups,
                                                   diagnostics=ucfg.diagnostics)
        kw = [{} for _ in range(3)]
        if mesh is not None:  # gradients and accumulators sharded like the weights they stand for (FSDP)
            rep = sharding.replicated(mesh)
            one = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.trainable)
            acc = Accum(sharding.tree_shardings(jax.eval_shape(zero, state.trainable, None).grads, mesh, rules),
                        rep, rep, rep)
            kw = [dict(out_shardings=ItemGrad(rep, sharding.tree_shardings(one, mesh, rules), rep)),
                  dict(out_shardings=acc), dict(out_shardings=(sharding.tree_shardings(state, mesh, rules), rep))]
        programs.update(
            item=jax.jit(item, static_argnames=("shape",), **kw[0]), zero=jax.jit(zero, **kw[1]),
            accumulate=jax.jit(lambda *a: accumulate(*a, diagnostics=ucfg.diagnostics), donate_argnums=(0,),
                               **kw[1]),
            finish=jax.jit(lambda state, acc, den: finish(state, acc, den, tx=tx, tables=tables,
                                                          diagnostics=ucfg.diagnostics, levers=levers),
                           donate_argnums=(0,), **kw[2]))
        return programs

    def put(tree, rows_first: bool = True):
        """Host values onto the mesh (rows over the data axes, scalars replicated); as they are without one."""
        if mesh is None:
            return tree
        return jax.device_put(tree, jax.tree_util.tree_map(
            lambda x: sharding.batch_sharding(x, mesh, 0, rules) if rows_first and np.ndim(x)
            else sharding.replicated(mesh), tree))

    def step(state: TrainState, base, batch: TrainBatch):
        if mesh is not None:  # a no-op for arrays already in place (the trainer's), so donation still works
            state, base = jax.device_put((state, base), (sharding.tree_shardings(state, mesh, rules),
                                                         sharding.tree_shardings(base, mesh, rules)))
        fns = compiled(state)
        batch = jax.tree_util.tree_map(np.asarray, batch)  # laid out on the host, item by item
        if ucfg.packing and not budget:  # fixed micro-batches read their packing from the batch
            batch = _packed(ucfg, batch)
        den = np.maximum(np.asarray(batch.den, np.float32), np.float32(1.0))
        acc = None
        for it in layout.plan_items(batch, micro_batch=ucfg.micro_batch, length_buckets=ucfg.length_buckets,
                                    grid=ucfg.length_grid, packing=ucfg.packing, share_prefix=ucfg.share_prefix,
                                    max_tokens=budget, by_group=ucfg.diagnostics,
                                    head_over_rows=not head_on_scored):
            rows = item_rows(batch, it, head_on_scored=head_on_scored)
            group, misaligned = _item_group(rows.group)
            slot = put(np.int32(it.slot), rows_first=False)
            out = fns["item"](state.trainable, base, put(rows), slot, put(den[it.slot], rows_first=False),
                              shape=it.shape)
            acc = fns["zero"](state.trainable, out.stats) if acc is None else acc
            acc = fns["accumulate"](acc, out, slot, *put((np.int32(group), np.int32(misaligned)), rows_first=False))
        if acc is None:  # no trained row (every advantage 0, no KL or entropy term): the optimizer still steps
            acc = fns["zero"](state.trainable, None)
        return fns["finish"](state, acc, put(den, rows_first=False))

    def shapes(T: int, W: int) -> list[layout.ItemShape]:
        """Every item shape a batch padded to T with scored window W can give (layout.update_shapes)."""
        return layout.update_shapes(T, W, micro_batch=ucfg.micro_batch, length_buckets=ucfg.length_buckets,
                                    grid=ucfg.length_grid, packing=ucfg.packing, max_tokens=budget,
                                    head_over_rows=not head_on_scored, share=ucfg.share_prefix > 0)

    def warmup(state: TrainState, base, T: int, W: int, workers: int = 1) -> int:
        """Compile, without running, every program a step over batches padded to T (scored window W) can call:
        each item shape of shapes(T, W) with exactly the arguments a step passes it (padding rows), and the
        accumulators and the optimizer step. Later steps then compile nothing. workers > 1 compiles that many
        programs at once (threads: XLA compiles outside the GIL). Returns the programs compiled."""
        import concurrent.futures

        fns = compiled(state)
        S = jax.tree_util.tree_leaves(state.trainable)[0].shape[0]
        z = lambda *shape, dtype=np.int32: np.zeros(shape, dtype)
        dummy = TrainBatch(tokens=z(S, 1, T), valid=z(S, 1, T, dtype=bool), win_start=z(S, 1), targets=z(S, 1, W),
                           loss_mask=z(S, 1, W, dtype=np.float32), old_logp=z(S, 1, W, dtype=np.float32),
                           advantages=z(S, 1, dtype=np.float32), row_weight=z(S, 1, dtype=np.float32),
                           group=z(S, 1) - 1, kl_coef=z(S, 1, dtype=np.float32), den=np.ones(S, np.float32),
                           length=z(S, 1))
        slot, den = put(np.int32(0), rows_first=False), put(np.float32(1.0), rows_first=False)

        def item_args(key: layout.ItemShape):
            n = key.rows
            pack = (layout.RowPacking(*[z(n)] * (4 if ucfg.share_prefix else 2)) if isinstance(key.shape, Packed)
                    else None)
            rows = item_rows(dummy, layout.Item(0, np.full(n, -1), key.shape, pack), head_on_scored=head_on_scored)
            return (state.trainable, base, put(rows), slot, den)

        keys = shapes(T, W)
        # Traced here, one at a time (flax builds its remat classes while tracing, and that is not
        # thread-safe); compiled in threads (XLA compiles outside the GIL).
        lowered = [fns["item"].lower(*item_args(key), shape=key.shape) for key in keys]
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
            items = list(pool.map(lambda low: low.compile(), lowered))
        # The accumulators and the optimizer step: their shapes follow the weights and the stats, not the items.
        out = _outputs(lowered[0], items[0], mesh)
        zero = [fns["zero"].lower(state.trainable, stats) for stats in (out.stats, None)]
        acc = [_outputs(low, low.compile(), mesh) for low in zero]  # after an item; with none (no trained row)
        scalar = put(np.int32(0), rows_first=False)
        fns["accumulate"].lower(acc[0], out, slot, scalar, scalar).compile()
        for a in acc:
            fns["finish"].lower(state, a, put(np.ones(S, np.float32), rows_first=False)).compile()
        return len(keys) + 5

    step.item_programs = lambda: programs["item"]._cache_size() if programs else 0
    step.shapes = shapes
    step.warmup = warmup
    return step


def _outputs(lowered, compiled, mesh):
    """What a step's later programs are lowered on: on a mesh the compiled outputs with their shardings; on one
    device without any (a device's sharding is another cache key there)."""
    return lowered.out_info if mesh is None else sharding.compiled_outputs(compiled)


def _packed(ucfg: UpdateConfig, batch: TrainBatch) -> TrainBatch:
    """The batch with its micro-batches' packing (layout.pack_batch) when it has none yet."""
    if batch.pack_shape is None:
        return pack_batch(batch, ucfg.micro_batch, ucfg.share_prefix, ucfg.length_grid)
    if ucfg.share_prefix and batch.pack_share is None:
        raise ValueError("UpdateConfig.share_prefix needs the batch packed with it "
                         "(rl.layout.pack_batch(..., share_prefix=...)) or not packed at all")
    return batch


def _item_group(group: np.ndarray) -> tuple[int, int]:
    """An item's group (its rows' largest, -1 when all padding) and how many of its rows belong to another."""
    g = int(np.max(group))
    return g, int(np.sum((group >= 0) & (group != g)))


def init_state(trainable, tx) -> TrainState:
    return TrainState(trainable, tx.init(trainable), jnp.int32(0), jnp.int32(0))
