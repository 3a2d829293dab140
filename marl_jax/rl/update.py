"""The jitted GRPO update: per-slot losses, one (slot, micro-batch) item at a time, exact per-group gradients.

One call of `train_step` takes a TrainBatch ([S, R, T], see marl_jax.rl.batch) and:
  1. runs work items, one per (slot, micro-batch): micro_batch rows, or as many as a token budget holds
     (max_tokens_per_micro_batch), laid out on the host by marl_jax.rl.layout. In each, a forward pass on
     that slot's parameters gives every row's loss numerator and one VJP (cotangent = row weight / the slot's
     denominator) its gradient. Items holding padding only are skipped, and each item runs over a
     token window just long enough for its longest row (one of `length_ladder(T)`, chosen per item),
     so short micro-batches do not pay for the batch's longest row. The loss is a sum of
     per-row terms over a denominator fixed for the whole batch, so accumulating micro-batch
     gradients is exact. With diagnostics on, the batch is group-aligned (every micro-batch
     holds rows of one diagnostic group), so each micro-batch gradient is added to its group's
     accumulator: exact per-group gradients for the price of one backward pass;
  2. sums the group gradients per slot into the slot gradient (exactly the gradient of the slot's
     loss, so under Shared-Policy the per-role gradients add up to the full gradient by
     construction) and measures per-role norms, projection shares, cosines and copy alignment;
  3. clips and applies AdamW per slot (optim.per_slot), unless the loss or any gradient is not
     finite: then the update is skipped and counted, and parameters stay as they were.

Step 1 runs as one program per item shape (UpdateConfig.program="items", the default): an RL batch's
rows, padded length and packed shapes change nearly every step, and a program over the whole batch
compiled again each time (~11 s a step for the embedded default run, cold cache); an item's program
depends only on its own window or packed shape, so a run stops compiling after its first steps. Under a
mesh every item's rows are placed over the data axes and each program's outputs keep the shardings of
what they stand for (a slot's gradient like its weights, accumulators like the fused program's, the new
state like the old), so nothing is gathered; program="fused" runs the step as one program (a scan over
the items) instead, with the same values.

Each slot's loss is normalised by its own rows, so an Isolated-Policy slot's step does not depend
on how many rows other roles had: the reference's separate per-role updates.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

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
# The memory model remat="auto" reads (marl_jax.rl.memory), importable from here as well.
from marl_jax.rl.memory import remat_for  # noqa: F401
# The host-side layout (marl_jax.rl.layout), importable from here as well.
from marl_jax.rl.layout import (item_positions, item_windows, length_ladder, pack_batch, pack_rows,  # noqa: F401
                                pack_shapes, pack_units, share_units)


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
    # Sequence packing: the rows of a micro-batch are laid end to end in fewer sequences (segment ids,
    # per-row positions, attention within a row only), each item over the packed shape (sequences x
    # window, from pack_shapes) with the fewest positions. Values are unchanged (tests/test_update_layout.py).
    packing: bool = False
    # With packing: rows of a micro-batch whose tokens start with the same share_prefix or more tokens (a
    # task's episodes, a role's instructions) are laid over one copy of that prefix, computed once; their
    # gradients through it add up as they would over separate copies. 0: off.
    share_prefix: int = 0
    # "items" (and "auto"): each (slot, micro-batch) item runs its own program, compiled once per item shape
    # for the whole run, on one device or a mesh; "fused": the step is one program over the batch's shape
    # (compiled again whenever the batch's rows, length or packed shapes change: nearly every RL step).
    # Both compute the same values.
    program: str = "auto"
    # Token-budget micro-batches (verl's use_dynamic_bsz / ppo_max_token_len_per_gpu): each micro-batch holds
    # as many rows of one slot (and diagnostic group) as this many computed positions allow (rows x window,
    # or packed sequences x window), not micro_batch rows: one long row alone, many short rows together.
    # Row counts and windows sit on the length grid (layout.budget_items). 0: off, micro_batch rows each.
    max_tokens_per_micro_batch: int = 0

    def __post_init__(self):
        if self.old_logp not in ("sampler", "recompute"):
            raise ValueError(f"old_logp must be 'sampler' or 'recompute', got {self.old_logp!r}")
        if self.agg not in L.AGG_MODES:
            raise ValueError(f"agg must be one of {L.AGG_MODES}, got {self.agg!r}")
        if self.micro_batch < 1:
            raise ValueError(f"micro_batch must be >= 1, got {self.micro_batch}")
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
        if self.program not in ("auto", "items", "fused"):
            raise ValueError(f"program must be 'auto', 'items' or 'fused', got {self.program!r}")
        if self.head_chunk < 0:
            raise ValueError(f"head_chunk must be >= 0 (0 = automatic), got {self.head_chunk}")
        if self.max_tokens_per_micro_batch < 0:
            raise ValueError("max_tokens_per_micro_batch must be >= 0 (0 = off: micro_batch rows per "
                             f"micro-batch), got {self.max_tokens_per_micro_batch}")
        if self.max_tokens_per_micro_batch and self.program == "fused":
            raise ValueError("max_tokens_per_micro_batch needs program='items' or 'auto': the fused program scans "
                             "micro-batches of one row count")


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


def pack_item(r, p: int, t: int, T: int):
    """An item's rows laid into p packed sequences of t tokens: (put, segments), put(x) scatters a [rows, <=T]
    array of the rows into [p, t]; segments is what decoder.forward takes (ids, or (ids, parents, positions)
    over shared prefixes). r: the item's rows (tokens, length, pack_seq, pack_off, and pack_pre / pack_share)."""
    n, tw = r["tokens"].shape[0], min(t, T)  # a row is at most T long; a packed sequence may be longer
    q = jnp.arange(tw)[None]
    live = q < r["length"][:, None]  # [mb, tw]
    dst_seq = jnp.where(live, r["pack_seq"][:, None], p)  # padding goes out of bounds: dropped
    dst_pos = r["pack_off"][:, None] + q
    seg = jnp.broadcast_to(jnp.arange(1, n + 1, dtype=jnp.int32)[:, None], (n, tw))
    segments = None
    if "pack_share" in r:
        # A row's first c tokens go to its unit's one prefix copy (every member writes the same
        # values there), segment id n + 1 + its offset; the rest attend to it as their parent.
        c, pre = r["pack_share"][:, None], r["pack_pre"][:, None]
        in_pre = q < c
        dst_pos = jnp.where(in_pre, pre + q, dst_pos)
        prefix_id = jnp.broadcast_to(n + 1 + pre, (n, tw))
    put = lambda x: jnp.zeros((p, t), jnp.int32).at[dst_seq, dst_pos].set(x, mode="drop")
    if "pack_share" in r:
        segments = (put(jnp.where(in_pre, prefix_id, seg)),
                    put(jnp.where(in_pre | (c == 0), 0, prefix_id)),
                    put(jnp.broadcast_to(q, (n, tw))))
    return put, segments or put(seg)


def _tree_dot(a, b):
    return sum(jnp.vdot(x.astype(jnp.float32), y.astype(jnp.float32)).real
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _row_terms(cfg: ModelConfig, spec: PolicySpec, ucfg: UpdateConfig, base, one_slot, rows, mesh=None, rules=None,
               *, norm_len: int | None = None, remat: str | None = None):
    """Per-row loss numerators for one slot's micro-batch; aux = token log-probs (+ ref, entropy).

    norm_len: the sequence-sum normaliser when ucfg.max_len_norm is unset (the whole batch's W, also
    when this item runs over a shorter window). remat: this item's mode (default ucfg.remat)."""
    params, lora = unstacked(spec, base, one_slot)
    N, W = rows["targets"].shape
    idx = jnp.minimum(rows["win_start"][:, None] + jnp.arange(W), rows["tokens"].shape[1] - 1)
    want_entropy = ucfg.entropy_coef != 0.0 or ucfg.metrics
    chunk, flat = head_chunk(N, W, cfg.vocab_size, ucfg.head_chunk, sharded=mesh is not None)

    def window_logprobs(p, lo, entropy: bool):
        packed = "pack_tokens" in rows
        h = decoder.forward(p, cfg, rows["pack_tokens"] if packed else rows["tokens"], None if packed else rows["valid"],
                            lora=lo, lora_scale=spec.scale, dtype=ucfg.dtype, return_hidden=True,
                            remat=remat or ucfg.remat, mesh=mesh, rules=rules,
                            segments=rows["pack_segments"] if packed else None, unroll=ucfg.unroll,
                            right_padded=not packed)  # batch rows: prompt + completion, then padding
        if packed:  # each row's scored positions, read back from where its row was laid in the packed sequences
            pos = rows["pack_off"][:, None] + idx
            if "pack_share" in rows:  # positions inside a shared prefix are read from its one copy
                pos = jnp.where(idx < rows["pack_share"][:, None], rows["pack_pre"][:, None] + idx, pos)
            pos = jnp.minimum(pos, h.shape[1] - 1)
            seq = jnp.broadcast_to(rows["pack_seq"][:, None], pos.shape)
            if "head_idx" in rows:  # only the scored positions' hidden states, not every row's window
                at = jnp.minimum(rows["head_idx"], N * W - 1)
                h = h[seq.reshape(-1)[at], pos.reshape(-1)[at]][None]
            else:
                h = h[seq, pos]
        else:
            h = jnp.take_along_axis(h, idx[..., None], axis=1)  # [mb, W, D]: only positions that are scored
        head = lambda x: decoder.unembed(p, cfg, x, mesh=mesh, rules=rules)
        if "head_idx" in rows:  # the item's scored positions only, laid as one row (scored_positions)
            hi = rows["head_idx"]
            at = jnp.minimum(hi, N * W - 1)
            c, _ = head_chunk(1, hi.shape[0], cfg.vocab_size)
            lp, ent = L.head_logprobs(head, h, rows["targets"].reshape(N * W)[at][None],
                                      entropy=entropy, chunk=c)
            back = lambda x: jnp.zeros((N * W,), x.dtype).at[hi].set(x[0], mode="drop").reshape(N, W)
            return back(lp), (None if ent is None else back(ent))
        if flat:  # the item's scored positions as one row: a chunk's logits do not grow with its rows
            lp, ent = L.head_logprobs(head, h.reshape(1, N * W, -1), rows["targets"].reshape(1, N * W),
                                      entropy=entropy, chunk=chunk)
            return lp.reshape(N, W), (None if ent is None else ent.reshape(N, W))
        return L.head_logprobs(head, h, rows["targets"], entropy=entropy, chunk=chunk)

    logp, entropy = window_logprobs(params, lora, want_entropy)
    if entropy is not None and ucfg.entropy_coef == 0.0:
        entropy = jax.lax.stop_gradient(entropy)
    ref = None
    if ucfg.kl:  # the frozen base model is the reference (LoRA off / the initial full weights)
        ref = jax.lax.stop_gradient(window_logprobs(base, None, False)[0])
    old = jax.lax.stop_gradient(logp) if ucfg.old_logp == "recompute" else rows["old_logp"]

    def one_row(lp, ol, adv, m, ent, rf, kc):
        num, _ = L.policy_loss_terms(
            lp[None], ol[None], adv[None], m[None], clip_low=ucfg.clip_low, clip_high=ucfg.clip_high,
            dual_clip=ucfg.dual_clip, agg=ucfg.agg, max_len_norm=ucfg.max_len_norm or norm_len or lp.shape[-1],
            ref_logp=None if rf is None else rf[None], kl_coef=kc if ucfg.kl else 0.0,
            kl_estimator=ucfg.kl_estimator, entropy=None if ent is None else ent[None],
            entropy_coef=ucfg.entropy_coef)
        return num

    nums = jax.vmap(one_row, in_axes=(0, 0, 0, 0, None if entropy is None else 0, None if ref is None else 0, 0))(
        logp, old, rows["advantages"], rows["loss_mask"], entropy, ref, rows["kl_coef"])
    aux = {"logp": jax.lax.stop_gradient(logp), "old": old}
    if entropy is not None:
        aux["entropy"] = jax.lax.stop_gradient(entropy)
    if ref is not None:
        aux["ref"] = ref
    return nums, aux


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


def _item_group(grp, xp=jnp):
    """An item's group (its rows' largest, -1 when all padding) and how many of its rows belong to another."""
    mg = xp.max(grp)
    return mg, xp.sum((grp >= 0) & (grp != mg)).astype(xp.int32)


def make_train_step(cfg: ModelConfig, spec: PolicySpec, ucfg: UpdateConfig, tx: optax.GradientTransformation,
                    *, num_groups: int, group_slot, group_role, num_roles: int, role_slot, mesh=None, rules=None,
                    levers=None):
    """Build the jitted step. Group/role tables are static per workflow (host tuples).

    group_slot[g], group_role[g]: slot and role index of diagnostic group g; role_slot[k]: slot of role k.
    Returns step(state, base, batch) -> (state, metrics).

    With a mesh, the program's input and output shardings come from the logical axis rules
    (marl_jax.models.sharding): the base and the slot-stacked trainable weights, their optimizer
    state and the gradient accumulators by parameter name (FSDP over "fsdp", tensor parallelism over
    "model"), batch rows over data x fsdp; metrics are replicated. Nothing is gathered to the host.

    The functions below are in the order a step runs them: the host lays the batch out into work items,
    each item computes its rows' loss terms and gradient, items are accumulated per group, and `finish`
    turns the accumulators into diagnostics and the optimizer step. `itemwise` runs that as one program
    per item shape, `fused` as one program for the whole step.
    """
    G, K = num_groups, num_roles
    g_slot = jnp.asarray(group_slot, jnp.int32)
    g_role = jnp.asarray(group_role, jnp.int32)
    k_slot = jnp.asarray(role_slot, jnp.int32)
    budget = ucfg.max_tokens_per_micro_batch
    # Packed items of the item-by-item step run the LM head over their completion tokens only (scored_positions)
    head_on_scored = ucfg.packing and mesh is None and not ucfg.head_chunk

    # ---- 1. the host: the batch's rows and its work items ----
    def pack(batch: TrainBatch) -> TrainBatch:
        """The batch with its micro-batches' packing (layout.pack_batch) when packing is on and it has none."""
        if ucfg.packing and batch.pack_shape is None:
            return pack_batch(batch, ucfg.micro_batch, ucfg.length_buckets, ucfg.share_prefix, ucfg.length_grid)
        return batch

    def rows_of(batch: TrainBatch, xp=jnp, packed: bool = ucfg.packing):
        """The per-row arrays an item reads, as a dict; packed: with the batch's packing (validated)."""
        rows = {"tokens": batch.tokens, "valid": batch.valid, "win_start": batch.win_start,
                "targets": batch.targets, "loss_mask": batch.loss_mask,
                "old_logp": batch.old_logp, "advantages": batch.advantages, "kl_coef": batch.kl_coef}
        if batch.length is not None:
            rows["length"] = batch.length
        if packed:
            if batch.pack_shape is None:
                raise ValueError("UpdateConfig.packing needs the batch's packing (rl.layout.pack_batch); the step "
                                 "returned by make_train_step adds it on the host")
            rows.update(pack_seq=batch.pack_seq, pack_off=batch.pack_off, pack_shape=batch.pack_shape)
            if ucfg.share_prefix:
                if batch.pack_share is None:
                    raise ValueError("UpdateConfig.share_prefix needs the batch packed with it "
                                     "(rl.layout.pack_batch(..., share_prefix=...))")
                rows.update(pack_pre=batch.pack_pre, pack_share=batch.pack_share)
        return {k: xp.asarray(v) for k, v in rows.items()}

    def plan(batch: TrainBatch) -> list[layout.Item]:
        """The batch's work items in the order they run (layout.plan_items)."""
        return layout.plan_items(batch, micro_batch=ucfg.micro_batch, length_buckets=ucfg.length_buckets,
                                 grid=ucfg.length_grid, packing=ucfg.packing, share_prefix=ucfg.share_prefix,
                                 max_tokens=budget, by_group=ucfg.diagnostics, head_over_rows=not head_on_scored)

    # ---- 2. one item: a forward pass, every row's loss terms, one VJP ----
    def terms_over(t, T, W, mb):
        """Row numerators, gradient and aux of one item computed over its first t positions (every row of
        the item is at most t tokens long, so causal attention gives the same values as over all T)."""
        Wt = min(W, t)  # a completion is shorter than its row
        remat = ucfg.remat
        if remat == "auto":  # per window: short items keep their activations, long ones recompute
            remat = remat_for(cfg, mb, t, Wt, ucfg.remat_budget_gb * 2 ** 30,
                              dtype="bfloat16" if jnp.dtype(ucfg.dtype) == jnp.bfloat16 else "float32",
                              rank=spec.rank if spec.mode == "lora" else 0)

        def run(mine, base, r, cot):
            rt = dict(r, tokens=r["tokens"][:, :t], valid=r["valid"][:, :t], targets=r["targets"][:, :Wt],
                      loss_mask=r["loss_mask"][:, :Wt], old_logp=r["old_logp"][:, :Wt])
            terms = lambda tr: _row_terms(cfg, spec, ucfg, base, tr, rt, mesh, rules, norm_len=W, remat=remat)
            nums, vjp, aux = jax.vjp(terms, mine, has_aux=True)
            (gr,) = vjp(cot.astype(nums.dtype))
            aux = jax.tree_util.tree_map(lambda a: jnp.pad(a, ((0, 0), (0, W - Wt))), aux)
            return nums, gr, aux
        return run

    def packed_over(p, t, T, W, mb):
        """As terms_over(t), with the item's rows laid end to end in p sequences of t tokens."""
        inner = terms_over(t, T, W, mb)

        def run(mine, base, r, cot):
            put, segments = pack_item(r, p, t, T)
            rp = dict(r, pack_tokens=put(r["tokens"][:, :min(t, T)]), pack_segments=segments)
            return inner(mine, base, rp, cot)
        return run

    def role_stats(aux, r, w, grp, W):
        """Additive loss stats per role for one item: dict of [K]."""
        def for_role(k):
            in_role = (jnp.take(g_role, jnp.maximum(grp, 0)) == k) & (grp >= 0)
            rw = w * in_role
            st = L.policy_loss_stats(
                aux["logp"], aux["old"], r["advantages"], r["loss_mask"], clip_low=ucfg.clip_low,
                clip_high=ucfg.clip_high, dual_clip=ucfg.dual_clip, agg=ucfg.agg,
                max_len_norm=ucfg.max_len_norm or W, ref_logp=aux.get("ref"), kl_estimator=ucfg.kl_estimator,
                entropy=aux.get("entropy"), row_weight=rw)
            st["rows"] = jnp.sum(rw)
            st["resp_tokens"] = jnp.sum(r["loss_mask"] * rw[..., None])
            return st
        return jax.vmap(for_role)(jnp.arange(K))

    def item(trainable, base, r, w, grp, slot, cot, *, kind, T, W):
        """One item on its slot's parameters: its weighted loss numerator, its gradient and its role stats."""
        mine = jax.tree_util.tree_map(lambda x: x[slot], trainable)
        mb = w.shape[0]
        fn = packed_over(kind[1], kind[2], T, W, mb) if kind[0] == "pack" else terms_over(kind[1], T, W, mb)
        nums, gr, aux = fn(mine, base, r, cot)
        return jnp.sum(nums * w), gr, (role_stats(aux, r, w, grp, W) if ucfg.metrics else None)

    # ---- 3. accumulation over items ----
    def zero_acc(trainable):
        """Zero gradient accumulators: one per diagnostic group (diagnostics) or per slot."""
        one_slot_zero = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape[1:], x.dtype), trainable)
        return (jax.tree_util.tree_map(lambda x: jnp.zeros((G,) + x.shape, x.dtype), one_slot_zero)
                if ucfg.diagnostics else jax.tree_util.tree_map(jnp.zeros_like, trainable))

    def start(trainable, st, S):
        """The accumulators before the first item: zero gradients and sums, maxima below any value."""
        role_st = None if st is None else {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0, v.dtype)
                                           for k, v in st.items()}
        return zero_acc(trainable), jnp.zeros((S,), jnp.float32), jnp.int32(0), role_st

    def add_grad(acc, gr, slot, grp_id):
        """Add one item's gradient to its group's accumulator (diagnostics; grp_id -1: dropped) or its slot's."""
        if ucfg.diagnostics:
            at = jnp.where(grp_id >= 0, grp_id, G)
            return jax.tree_util.tree_map(lambda a, g: a.at[at].add(g, mode="drop"), acc, gr)
        return jax.tree_util.tree_map(lambda a, g: a.at[slot].add(g), acc, gr)

    def accumulate(carry, num, gr, st, slot, grp_id, mix):
        """Fold one item into the carry: its gradient, loss numerator, misaligned rows and role stats."""
        acc, num_total, mixed, role_st = carry
        acc = add_grad(acc, gr, slot, grp_id)
        if st is not None:
            role_st = {k: (jnp.maximum(role_st[k], v) if k.endswith("_max") else role_st[k] + v)
                       for k, v in st.items()}
        return acc, num_total.at[slot].add(num), mixed + (mix if ucfg.diagnostics else 0), role_st

    # ---- 4. after the last item: diagnostics, levers, the optimizer ----
    def finish(state: TrainState, acc, num_total, mixed, role_st, den):
        """From the accumulated item gradients: per-role diagnostics, levers, clipping and the optimizer."""
        S = den.shape[0]
        loss_per_slot = num_total / den
        metrics = {"loss": jnp.sum(loss_per_slot), "loss_per_slot": loss_per_slot}
        role_g = None
        if ucfg.diagnostics:  # rows of another group in a micro-batch: the batch was not group-aligned
            metrics["misaligned_rows"] = mixed
            grads, role_g, diag = _role_diagnostics(acc, g_slot, g_role, k_slot, S, K)
            metrics.update(diag)
        else:
            grads = acc
        new_ema = state.grad_ema
        if levers is not None and levers.active:  # damping, fan-out, balancing (marl_jax.rl.levers)
            from marl_jax.rl import levers as LV
            grads, new_ema, metrics["levers"] = LV.apply(levers, role_g, state.grad_ema, k_slot, S)
        from marl_jax.rl.optim import global_norm_per_slot
        metrics["slot_grad_norm"] = global_norm_per_slot(grads)
        if role_st is not None:
            metrics["role_stats"] = role_st
        finite = jnp.isfinite(metrics["loss"]) & jnp.all(jnp.isfinite(metrics["slot_grad_norm"]))
        metrics["finite"] = finite
        return _apply_if_finite(tx, state, grads, new_ema, finite), metrics

    # ---- running steps 2-4: one program per item shape ----
    # A program over the whole batch has the batch's shape (rows, length, packed shapes used), which changes
    # from step to step in RL, so it would compile again nearly every step. Run item by item instead, each
    # item's program keyed by its own shape only (window or packed shape, rows, completion window): after the
    # first steps every program is compiled, and the persistent cache serves them across runs.
    programs = {}  # built at the first step: under a mesh their shardings follow the state's shapes

    def item_programs(state):
        """The jitted item, accumulate, start and finish programs (with output shardings under a mesh)."""
        if not programs:
            kw = [{} for _ in range(4)]
            if mesh is not None:
                rep = sharding.replicated(mesh)
                one = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.trainable)
                acc = sharding.tree_shardings(jax.eval_shape(zero_acc, state.trainable), mesh, rules)
                kw = [dict(out_shardings=(rep, sharding.tree_shardings(one, mesh, rules), rep)),
                      dict(out_shardings=(acc, rep, rep, rep)), dict(out_shardings=(acc, rep, rep, rep)),
                      dict(out_shardings=(sharding.tree_shardings(state, mesh, rules), rep))]
            programs.update(item=jax.jit(item, static_argnames=("kind", "T", "W"), **kw[0]),
                            accumulate=jax.jit(accumulate, donate_argnums=(0,), **kw[1]),
                            start=jax.jit(start, static_argnums=(2,), **kw[2]),
                            finish=jax.jit(finish, donate_argnums=(0,), **kw[3]))
        return programs

    def put(tree, rows_first: bool = True):
        """Host values onto the mesh (rows over the data axes, scalars replicated); as they are without one."""
        if mesh is None:
            return tree
        return jax.device_put(tree, jax.tree_util.tree_map(
            lambda x: sharding.batch_sharding(x, mesh, 0, rules) if rows_first and np.ndim(x)
            else sharding.replicated(mesh), tree))

    def itemwise(state: TrainState, base, batch: TrainBatch):
        """The step item by item: each item's rows gathered on the host, its program, the accumulators, finish."""
        if mesh is not None:  # a no-op for arrays already in place (the trainer's), so donation still works
            state, base = jax.device_put((state, base), (sharding.tree_shardings(state, mesh, rules),
                                                         sharding.tree_shardings(base, mesh, rules)))
        fns = item_programs(state)
        rows = rows_of(batch, np, packed=ucfg.packing and not budget)  # a budget's items carry their own packing
        S, R, T = rows["tokens"].shape
        W = rows["targets"].shape[2]
        den = np.maximum(np.asarray(batch.den, np.float32), np.float32(1.0))
        weight, group = np.asarray(batch.row_weight, np.float32), np.asarray(batch.group, np.int32)
        carry = None
        for it in plan(batch):
            s, t = it.slot, min(it.kind[-1], T)
            # Columns past the window are never read: the program's shape does not depend on T.
            r = {k: layout.take_rows(v[s][:, :t] if k in ("tokens", "valid") else v[s], it.rows)
                 for k, v in rows.items()}
            if it.pack is not None:
                r.update(it.pack)
            if it.kind[0] == "pack" and head_on_scored:
                hi = scored_positions(r["loss_mask"][:, :min(W, t)], it.kind[1] * it.kind[2])
                if hi is not None:
                    r["head_idx"] = hi
            w, grp = layout.take_rows(weight[s], it.rows), layout.take_rows(group[s], it.rows, -1)
            grp_id, mix = _item_group(grp, np)
            r, w_, grp_, cot = put((r, w, grp, w / den[s]))
            slot, grp_id, mix = put((np.int32(s), np.int32(grp_id), np.int32(mix)), rows_first=False)
            num, gr, st = fns["item"](state.trainable, base, r, w_, grp_, slot, cot, kind=it.kind, T=t, W=W)
            if carry is None:
                carry = fns["start"](state.trainable, st, S)
            carry = fns["accumulate"](carry, num, gr, st, slot, grp_id, mix)
        if carry is None:  # no trained row at all (rare): the fused program handles the empty batch
            return fallback(state, base, pack(batch), (0,) if ucfg.packing else None)
        acc, num_total, mixed, role_st = carry
        return fns["finish"](state, acc, num_total, mixed, role_st, put(den, rows_first=False))

    # ---- or steps 2-4 as one program: a scan over the items ----
    def fused(state: TrainState, base, batch: TrainBatch, used: tuple[int, ...] | None = None):
        """The whole step as one program: a scan over items. used (packing, static): the pack_shapes indices
        the batch's items take; only these compile."""
        S, R, T = batch.tokens.shape
        mb = min(ucfg.micro_batch, R)
        M = R // mb
        den = jnp.maximum(batch.den, 1.0)  # [S], counted on the host over every trained row
        rows = rows_of(batch)
        # [S, R, ...] -> [S * M, mb, ...]: one work item per (slot, micro-batch), slot-major. Items run one at
        # a time on their own slot's parameters, so an item of padding only (a slot with fewer rows than the
        # largest, bucketing, group alignment) is skipped outright: a slot vmap would compute every slot.
        W = batch.targets.shape[2]
        split = lambda x: x.reshape((S * M, mb) + x.shape[2:])
        mrows = jax.tree_util.tree_map(split, rows)
        if mesh is not None:  # each micro-batch's rows are split over data x fsdp
            mrows = jax.tree_util.tree_map(
                lambda x: sharding.constrain(x, (None, "batch") + (None,) * (x.ndim - 2), mesh, rules), mrows)
        mweight, mgroup = split(batch.row_weight), split(batch.group)
        mslot = jnp.repeat(jnp.arange(S, dtype=jnp.int32), M)
        ladder = length_ladder(T, ucfg.length_buckets, ucfg.length_grid) if batch.length is not None else (T,)

        def compute(carry, xs):
            """One item inside the scan: its packed shape or window chosen by a switch, then accumulated."""
            acc, num_total, mixed = carry
            r, w, grp, slot = xs
            mine = jax.tree_util.tree_map(lambda x: x[slot], state.trainable)
            cot = w / den[slot]
            if ucfg.packing:  # the item's packed shape, chosen on the host (pack_batch)
                shapes = pack_shapes(T, mb, ucfg.length_buckets, share=ucfg.share_prefix > 0,
                                     grid=ucfg.length_grid)
                ks = tuple(used) if used is not None else tuple(range(len(shapes)))
                which = jnp.searchsorted(jnp.asarray(ks, jnp.int32), jnp.max(r["pack_shape"]))
                nums, gr, aux = jax.lax.switch(jnp.minimum(which, len(ks) - 1),
                                               [packed_over(*shapes[k], T, W, mb) for k in ks], mine, base, r, cot)
            elif len(ladder) == 1:
                nums, gr, aux = terms_over(T, T, W, mb)(mine, base, r, cot)
            else:  # the shortest window that holds the item's longest row
                which = jnp.searchsorted(jnp.asarray(ladder, jnp.int32), jnp.max(r["length"]), side="left")
                nums, gr, aux = jax.lax.switch(jnp.minimum(which, len(ladder) - 1),
                                               [terms_over(t, T, W, mb) for t in ladder], mine, base, r, cot)
            num_total = num_total.at[slot].add(jnp.sum(nums * w))
            grp_id, mix = _item_group(grp)
            acc = add_grad(acc, gr, slot, grp_id)
            return ((acc, num_total, mixed + (mix if ucfg.diagnostics else 0)),
                    (role_stats(aux, r, w, grp, W) if ucfg.metrics else None))

        def body(carry, xs):
            """compute, or nothing for an item of padding only."""
            stats_shape = jax.eval_shape(lambda c, x: compute(c, x)[1], carry, xs)
            skip = lambda c, x: (c, jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape))
            return jax.lax.cond(jnp.any(xs[1] > 0), compute, skip, carry, xs)

        acc0 = zero_acc(state.trainable)
        if mesh is not None:  # gradient accumulators sharded like the weights they accumulate (FSDP)
            acc0 = jax.lax.with_sharding_constraint(acc0, sharding.tree_shardings(acc0, mesh, rules))
        (acc, num_total, mixed), mstats = jax.lax.scan(
            body, (acc0, jnp.zeros((S,), jnp.float32), jnp.int32(0)), (mrows, mweight, mgroup, mslot))
        role_st = None
        if ucfg.metrics:  # combine micro-batches: sums add, maxima take the max
            role_st = {k: (v.max(0) if k.endswith("_max") else v.sum(0)) for k, v in mstats.items()}
        return finish(state, acc, num_total, mixed, role_st, den)

    # ---- the step ----
    fn = fallback = (jax.jit(fused, donate_argnums=(0,), static_argnums=(3,)) if mesh is None
                     else _sharded_jit(fused, mesh, rules))
    if ucfg.program in ("auto", "items"):
        def items_step(state, base, batch):
            """The step, item by item (a token budget packs each item itself; fixed micro-batches are packed first)."""
            return itemwise(state, base, batch if budget else pack(batch))
        # compiled item programs so far
        items_step.item_programs = lambda: programs["item"]._cache_size() if programs else 0
        return items_step

    if not ucfg.packing:
        return fn

    def packed_step(state, base, batch):
        """The fused step over a packed batch."""
        batch = pack(batch)
        # Compile only the packed shapes this batch's items take (every shape would be many branches).
        length, shape = np.asarray(batch.length), np.asarray(batch.pack_shape)
        used = tuple(sorted({int(k) for k in np.unique(shape[length > 0])})) or (0,)
        return fn(state, base, batch, used)
    return packed_step


def _sharded_jit(step, mesh, rules):
    """jit `step` with shardings from the rules, built at the first call (they depend on the trees' shapes).
    Arguments are placed first (a no-op for arrays already in place, so donation still works)."""
    compiled = {}

    def call(state, base, batch, used=None):
        shapes = jax.tree_util.tree_map(jnp.shape, (state, base, batch))
        key = (jax.tree_util.tree_structure(shapes), tuple(jax.tree_util.tree_leaves(shapes)), used)
        if key not in compiled:  # shardings depend on shapes (a dimension the mesh does not divide stays whole)
            rows = lambda x: (sharding.batch_sharding(x, mesh, 1, rules) if jnp.ndim(x) >= 2
                              else sharding.replicated(mesh))
            shardings = (sharding.tree_shardings(state, mesh, rules), sharding.tree_shardings(base, mesh, rules),
                         jax.tree_util.tree_map(rows, batch))
            fn = jax.jit(functools.partial(step, used=used), donate_argnums=(0,), in_shardings=shardings,
                         out_shardings=(shardings[0], sharding.replicated(mesh)))
            compiled[key] = (fn, shardings)
        fn, shardings = compiled[key]
        return fn(*jax.device_put((state, base, batch), shardings))

    return call


def init_state(trainable, tx) -> TrainState:
    return TrainState(trainable, tx.init(trainable), jnp.int32(0), jnp.int32(0))
