"""The jitted GRPO update: per-slot losses, one (slot, micro-batch) item at a time, exact per-group gradients.

One call of `train_step` takes a TrainBatch ([S, R, T], see marl_jax.rl.batch) and:
  1. runs work items, one per (slot, micro-batch); in each, a forward pass on that slot's
     parameters gives every row's loss numerator and one VJP (cotangent = row weight / the slot's
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
from marl_jax.rl import loss as L
from marl_jax.rl.batch import TrainBatch


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


REMAT_MODES = ("none", "dots", "full", "auto")


def remat_for(cfg: ModelConfig, rows: int, t: int, W: int, budget_bytes: float, *, dtype: str = "float32",
              rank: int = 0) -> str:
    """The remat mode with the least recomputation ("none", then "dots") whose activations for one item
    of `rows` rows over t tokens (LM head on W positions) fit budget_bytes on one device, else "full".
    Bytes from marl_jax.plan's memory model (checked there against XLA's memory analysis)."""
    import types
    from marl_jax import plan
    conf = types.SimpleNamespace(model=types.SimpleNamespace(dtype=dtype),
                                 trainable=types.SimpleNamespace(mode="lora" if rank else "full", rank=rank))
    for mode in ("none", "dots"):
        knobs = plan.Knobs(mesh=plan.Mesh(), micro_batch=rows, remat=mode, max_batch=1)
        if plan.activation_bytes(cfg, conf, None, knobs, T=t, W=W) <= budget_bytes:
            return mode
    return "full"


def length_ladder(T: int, n: int, grid: int = 2) -> tuple[int, ...]:
    """The token windows an update over rows padded to T compiles: from T/n up to T, the lengths
    2^k (1 + i / grid) from 8 up, `grid` sizes per octave (2: 8, 12, 16, 24, 32, 48, ..., the grid batches
    are padded to), and T. Each micro-batch runs over the shortest that holds its longest
    row. One grid for every T: batches padded to other lengths share their items' programs. A finer grid
    computes fewer padding positions and compiles more item programs over a run (one per window used)."""
    if n <= 1:
        return (T,)
    out, b = {T}, 8
    while b < T:
        out |= {g for g in (b * (grid + i) // grid for i in range(grid)) if T / n <= g < T}
        b *= 2
    return tuple(sorted(out))


def item_windows(length, micro_batch: int, T: int, n: int, grid: int = 2):
    """Host-side: the token window each (slot, micro-batch) item of a batch runs over, as the update
    chooses it ([S, M]; 0 for items of padding only, which are skipped). length: the batch's [S, R]
    row lengths; T: its padded length; n: UpdateConfig.length_buckets."""
    import numpy as np
    length = np.asarray(length)
    S, R = length.shape
    mb = min(micro_batch, R)
    longest = length.reshape(S, R // mb, mb).max(-1)
    ladder = np.asarray(length_ladder(T, n, grid))
    which = np.minimum(np.searchsorted(ladder, longest, side="left"), len(ladder) - 1)
    return np.where(longest > 0, ladder[which], 0)


def pack_shapes(T: int, micro_batch: int, n: int, share: bool = False,
                grid: int = 2) -> tuple[tuple[int, int], ...]:
    """The (packed sequences, token window) shapes a packed update compiles: windows from length_ladder,
    sequences micro_batch, /2 and /4 (rounded up). When rows share prefixes also /8 and a window of 2T,
    so that the rows of a unit (their prefix laid once) mostly fit one sequence."""
    seqs = sorted({max(1, -(-micro_batch // d)) for d in ((1, 2, 4, 8) if share else (1, 2, 4))})
    return tuple((p, t) for t in length_ladder(T, n, grid) + ((2 * T,) if share else ()) for p in seqs)


def _common_prefix(a: np.ndarray, b: np.ndarray, n: int) -> int:
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if len(d) else n


def share_units(tokens: np.ndarray, lengths, minimum: int) -> list[tuple[list[int], int]]:
    """Host-side: rows grouped into units that share a prefix of >= `minimum` tokens, as (rows, shared
    length); rows alone have shared length 0. Longest rows lead; a leader takes the rows that maximise
    the tokens saved, (members - 1) x their common prefix with it."""
    left = sorted((i for i in range(len(lengths)) if lengths[i] > 0), key=lambda i: -int(lengths[i]))
    units = []
    while left:
        lead, rest = left[0], left[1:]
        lcp = sorted(((_common_prefix(tokens[lead], tokens[j], int(min(lengths[lead], lengths[j]))), j) for j in rest),
                     key=lambda cj: (-cj[0], cj[1]))
        best, k = 0, 0
        for m in range(1, len(lcp) + 1):
            c = lcp[m - 1][0]
            if c >= minimum and m * c > best:
                best, k = m * c, m
        members = [lead] + [j for _, j in lcp[:k]]
        c = lcp[k - 1][0] if k else 0
        units.append((members, c))
        left = [i for i in left if i not in members]
    return units


def pack_units(units, lengths, capacity: int) -> tuple[dict[int, tuple[int, int, int, int]], int]:
    """First-fit decreasing of shared-prefix units into sequences of `capacity` tokens: each row's
    (sequence, prefix offset, offset, shared length) with its token q >= shared length at offset + q and
    q < shared length at prefix offset + q; and the number of sequences used. A unit too long for one
    sequence is split, each part with its own copy of the prefix."""
    parts = []
    part = lambda rows, c: (rows, c, c + sum(int(lengths[i]) - c for i in rows)) if len(rows) > 1 else (
        rows, 0, int(lengths[rows[0]]))  # a row alone has nothing to share
    for rows, c in units:
        cur, size = [], c
        for i in rows:
            n = int(lengths[i]) - c
            if n + c > capacity:
                raise ValueError(f"a row of {n + c} tokens does not fit a packed sequence of {capacity}")
            if cur and size + n > capacity:
                parts.append(part(cur, c))
                cur, size = [], c
            cur.append(i)
            size += n
        parts.append(part(cur, c))
    where, fill = {}, []
    for rows, c, size in sorted(parts, key=lambda u: -u[2]):
        j = next((j for j, f in enumerate(fill) if f + size <= capacity), len(fill))
        if j == len(fill):
            fill.append(0)
        at, start = fill[j] + c, fill[j]
        for i in rows:
            where[i] = (j, start, at - c, c)
            at += int(lengths[i]) - c
        fill[j] += size
    return where, len(fill)


def pack_rows(lengths, capacity: int) -> tuple[list[int], list[int], int]:
    """First-fit decreasing: each row's (sequence, offset) in sequences of `capacity` tokens, and the
    number of sequences used. Rows of length 0 (padding) go nowhere (sequence 0, offset 0). pack_units
    with every row a unit of its own."""
    where, used = pack_units([([i], 0) for i in range(len(lengths)) if lengths[i] > 0], lengths, capacity)
    seq, off = [0] * len(lengths), [0] * len(lengths)
    for i, (j, _, o, _) in where.items():
        seq[i], off[i] = j, o
    return seq, off, used


def pack_batch(batch: TrainBatch, micro_batch: int, n: int, share_prefix: int = 0, grid: int = 2) -> TrainBatch:
    """Host-side: the packing of every micro-batch (TrainBatch.pack_*). For each item the packed shape
    with the fewest positions (sequences x window) that holds its rows; ties take the shorter window.
    share_prefix > 0: rows sharing a prefix of at least that many tokens are laid over one copy of it
    (share_units; TrainBatch.pack_pre / pack_share)."""
    if batch.length is None:
        raise ValueError("packing needs the rows' lengths (TrainBatch.length)")
    length = np.asarray(batch.length)
    S, R = length.shape
    T = batch.tokens.shape[2]
    mb = min(micro_batch, R)
    shapes = pack_shapes(T, mb, n, share=share_prefix > 0, grid=grid)
    tokens = np.asarray(batch.tokens) if share_prefix else None
    seq, off = np.zeros((S, R), np.int32), np.zeros((S, R), np.int32)
    pre, shared = np.zeros((S, R), np.int32), np.zeros((S, R), np.int32)
    shape = np.zeros((S, R), np.int32)
    for s in range(S):
        for m in range(R // mb):
            rows = slice(m * mb, (m + 1) * mb)
            lens = length[s, rows]
            if not lens.any():
                continue
            units = (share_units(tokens[s, rows], lens, share_prefix) if share_prefix
                     else [([i], 0) for i in range(mb) if lens[i] > 0])
            for k, (p, t) in sorted(enumerate(shapes), key=lambda kv: (kv[1][0] * kv[1][1], kv[1][1])):
                if t < lens.max():
                    continue
                where, used = pack_units(units, lens, t)
                if used <= p:
                    break
            # (mb, T) always holds the rows: one per sequence
            for i, (j, pr, of, c) in where.items():
                seq[s, m * mb + i], pre[s, m * mb + i], off[s, m * mb + i], shared[s, m * mb + i] = j, pr, of, c
            shape[s, rows] = k
    return batch._replace(pack_seq=seq, pack_off=off, pack_shape=shape,
                          pack_pre=pre if share_prefix else None, pack_share=shared if share_prefix else None)


def item_positions(batch: TrainBatch, micro_batch: int, n: int, packing: bool, share_prefix: int = 0, grid: int = 2):
    """Host-side: the token positions each (slot, micro-batch) item computes ([S, M]; 0 when skipped)."""
    S, R, T = batch.tokens.shape
    mb = min(micro_batch, R)
    if not packing:
        return item_windows(batch.length, micro_batch, T, n, grid) * mb
    b = batch if batch.pack_shape is not None else pack_batch(batch, micro_batch, n, share_prefix, grid)
    shapes = np.asarray([p * t for p, t in pack_shapes(T, mb, n, share=b.pack_share is not None, grid=grid)])
    live = np.asarray(b.length).reshape(S, R // mb, mb).max(-1) > 0
    return np.where(live, shapes[np.asarray(b.pack_shape)[:, ::mb]], 0)


_HEAD_BYTES = 256 * 2 ** 20  # one item's float32 logits above this are computed in chunks of positions


class TrainState(NamedTuple):
    trainable: Any  # slot-stacked
    opt_state: Any
    step: jax.Array
    skipped: jax.Array  # updates skipped for non-finite loss / gradients
    grad_ema: Any = None  # [K, ...] EMA of each role's past gradient (levers.damping; None when off)


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
    chunk = ucfg.head_chunk or (W if N * W * cfg.vocab_size * 4 <= _HEAD_BYTES
                                else max(8, _HEAD_BYTES // (4 * cfg.vocab_size * N)))

    def window_logprobs(p, lo, entropy: bool):
        packed = "pack_tokens" in rows
        h = decoder.forward(p, cfg, rows["pack_tokens"] if packed else rows["tokens"], None if packed else rows["valid"],
                            lora=lo, lora_scale=spec.scale, dtype=ucfg.dtype, return_hidden=True,
                            remat=remat or ucfg.remat, mesh=mesh, rules=rules,
                            segments=rows["pack_segments"] if packed else None, unroll=ucfg.unroll)
        if packed:  # each row's scored positions, read back from where its row was laid in the packed sequences
            pos = rows["pack_off"][:, None] + idx
            if "pack_share" in rows:  # positions inside a shared prefix are read from its one copy
                pos = jnp.where(idx < rows["pack_share"][:, None], rows["pack_pre"][:, None] + idx, pos)
            pos = jnp.minimum(pos, h.shape[1] - 1)
            h = h[rows["pack_seq"][:, None], pos]
        else:
            h = jnp.take_along_axis(h, idx[..., None], axis=1)  # [mb, W, D]: only positions that are scored
        head = lambda x: decoder.unembed(p, cfg, x, mesh=mesh, rules=rules)
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
    """
    G, K = num_groups, num_roles
    g_slot = jnp.asarray(group_slot, jnp.int32)
    g_role = jnp.asarray(group_role, jnp.int32)
    k_slot = jnp.asarray(role_slot, jnp.int32)

    def rows_of(batch: TrainBatch, xp=jnp):
        """The per-row arrays an item reads, as a dict; validates the batch's packing."""
        rows = {"tokens": batch.tokens, "valid": batch.valid, "win_start": batch.win_start,
                "targets": batch.targets, "loss_mask": batch.loss_mask,
                "old_logp": batch.old_logp, "advantages": batch.advantages, "kl_coef": batch.kl_coef}
        if batch.length is not None:
            rows["length"] = batch.length
        if ucfg.packing:
            if batch.pack_shape is None:
                raise ValueError("UpdateConfig.packing needs the batch's packing (rl.update.pack_batch); the step "
                                 "returned by make_train_step adds it on the host")
            rows.update(pack_seq=batch.pack_seq, pack_off=batch.pack_off, pack_shape=batch.pack_shape)
            if ucfg.share_prefix:
                if batch.pack_share is None:
                    raise ValueError("UpdateConfig.share_prefix needs the batch packed with it "
                                     "(rl.update.pack_batch(..., share_prefix=...))")
                rows.update(pack_pre=batch.pack_pre, pack_share=batch.pack_share)
        return {k: xp.asarray(v) for k, v in rows.items()}

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
            rp = dict(r, pack_tokens=put(r["tokens"][:, :tw]), pack_segments=segments or put(seg))
            return inner(mine, base, rp, cot)
        return run

    def finish(state: TrainState, acc, num_total, mixed, role_st, den):
        """From the accumulated item gradients: per-role diagnostics, levers, clipping and the optimizer."""
        S = den.shape[0]
        loss_per_slot = num_total / den
        metrics = {"loss": jnp.sum(loss_per_slot), "loss_per_slot": loss_per_slot}
        if ucfg.diagnostics:  # rows of another group in a micro-batch: the batch was not group-aligned
            metrics["misaligned_rows"] = mixed
            grads = jax.tree_util.tree_map(lambda x: jax.ops.segment_sum(x, g_slot, num_segments=S), acc)
            role_g = jax.tree_util.tree_map(lambda x: jax.ops.segment_sum(x, g_role, num_segments=K), acc)
            slot_of_role = jax.tree_util.tree_map(lambda x: x[k_slot], grads)  # [K, ...] slot grad of each role
            gram = jax.vmap(lambda a: jax.vmap(lambda b: _tree_dot(a, b))(
                role_g))(role_g)  # [K, K]
            role_norm = jnp.sqrt(jnp.maximum(jnp.diag(gram), 0.0))
            slot_dot = jax.vmap(_tree_dot)(role_g, slot_of_role)  # <g_k, g_slot(k)>
            slot_sq = jax.vmap(lambda a: _tree_dot(a, a))(slot_of_role)
            same_slot = k_slot[:, None] == k_slot[None, :]
            norm_sum = jnp.sum(jnp.where(same_slot, role_norm[None, :], 0.0), axis=1)
            group_sq = jax.vmap(lambda a: _tree_dot(a, a))(acc)  # [G]
            copies_sq = jax.ops.segment_sum(group_sq, g_role, num_segments=K)
            metrics.update(
                role_grad_norm=role_norm,
                role_grad_share=slot_dot / jnp.maximum(slot_sq, 1e-30),
                role_grad_norm_share=role_norm / jnp.maximum(norm_sum, 1e-30),
                role_grad_cos=gram / jnp.maximum(role_norm[:, None] * role_norm[None, :], 1e-30),
                role_copy_alignment=role_norm / jnp.sqrt(jnp.maximum(copies_sq, 1e-30)),
                group_grad_norm=jnp.sqrt(jnp.maximum(group_sq, 0.0)),
            )
        else:
            grads = acc
        new_ema = state.grad_ema
        if levers is not None and levers.active:  # damping, fan-out, balancing (marl_jax.rl.levers)
            from marl_jax.rl import levers as LV
            grads, new_ema, metrics["levers"] = LV.apply(levers, role_g if ucfg.diagnostics else None,
                                                         state.grad_ema, k_slot, S)
        from marl_jax.rl.optim import global_norm_per_slot
        metrics["slot_grad_norm"] = global_norm_per_slot(grads)
        if role_st is not None:
            metrics["role_stats"] = role_st

        finite = jnp.isfinite(metrics["loss"]) & jnp.all(jnp.isfinite(metrics["slot_grad_norm"]))
        safe_grads = jax.tree_util.tree_map(lambda g: jnp.where(finite, g, 0.0), grads)
        updates, new_opt = tx.update(safe_grads, state.opt_state, state.trainable)
        new_tr = optax.apply_updates(state.trainable, updates)
        keep = lambda new, old: jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, old)
        new_state = TrainState(keep(new_tr, state.trainable), keep(new_opt, state.opt_state),
                               state.step + 1, state.skipped + (~finite).astype(jnp.int32),
                               keep(new_ema, state.grad_ema))
        metrics["finite"] = finite
        return new_state, metrics

    def zero_acc(trainable):
        one_slot_zero = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape[1:], x.dtype), trainable)
        return (jax.tree_util.tree_map(lambda x: jnp.zeros((G,) + x.shape, x.dtype), one_slot_zero)
                if ucfg.diagnostics else jax.tree_util.tree_map(jnp.zeros_like, trainable))

    def add_grad(acc, gr, slot, grp):
        """Add one item's gradient to its group's accumulator (diagnostics) or its slot's; the count of
        its rows from other groups (0 when the batch is group-aligned)."""
        if ucfg.diagnostics:
            mg = jnp.max(grp)  # this item's group, -1 if all padding
            at = jnp.where(mg >= 0, mg, G)
            return (jax.tree_util.tree_map(lambda a, g: a.at[at].add(g, mode="drop"), acc, gr),
                    jnp.sum((grp >= 0) & (grp != mg)))
        return jax.tree_util.tree_map(lambda a, g: a.at[slot].add(g), acc, gr), jnp.int32(0)

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
            acc, mix = add_grad(acc, gr, slot, grp)
            return (acc, num_total, mixed + mix), (role_stats(aux, r, w, grp, W) if ucfg.metrics else None)

        def body(carry, xs):
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

    # ---- one program per item shape ----
    # The fused program's shape is the batch's (rows, length, packed shapes used), which changes from step to
    # step in RL, so it compiles again nearly every step. Run item by item instead, each item's program
    # keyed by its own shape only (window or packed shape, micro-batch, completion window): after the first
    # steps every program is compiled, and the persistent cache serves them across runs.
    def item(trainable, base, r, w, grp, slot, cot, *, kind, T, W):
        mine = jax.tree_util.tree_map(lambda x: x[slot], trainable)
        mb = w.shape[0]
        fn = packed_over(kind[1], kind[2], T, W, mb) if kind[0] == "pack" else terms_over(kind[1], T, W, mb)
        nums, gr, aux = fn(mine, base, r, cot)
        return jnp.sum(nums * w), gr, (role_stats(aux, r, w, grp, W) if ucfg.metrics else None)

    def accumulate(carry, num, gr, st, slot, grp):
        acc, num_total, mixed, role_st = carry
        acc, mix = add_grad(acc, gr, slot, grp)
        if st is not None:
            role_st = {k: (jnp.maximum(role_st[k], v) if k.endswith("_max") else role_st[k] + v)
                       for k, v in st.items()}
        return acc, num_total.at[slot].add(num), mixed + mix, role_st

    def start(trainable, st, S):
        """The accumulators before the first item: zero gradients and sums, maxima below any value."""
        role_st = None if st is None else {k: jnp.full(v.shape, -jnp.inf if k.endswith("_max") else 0, v.dtype)
                                           for k, v in st.items()}
        return zero_acc(trainable), jnp.zeros((S,), jnp.float32), jnp.int32(0), role_st

    fused_jit = jax.jit(fused, donate_argnums=(0,), static_argnums=(3,))
    programs = {}  # the item path's programs; under a mesh built at the first step (shardings follow the shapes)

    def item_programs(state):
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
        if mesh is not None:  # a no-op for arrays already in place (the trainer's), so donation still works
            state, base = jax.device_put((state, base), (sharding.tree_shardings(state, mesh, rules),
                                                         sharding.tree_shardings(base, mesh, rules)))
        fns = item_programs(state)
        rows = rows_of(batch, np)
        S, R, T = rows["tokens"].shape
        mb = min(ucfg.micro_batch, R)
        W = rows["targets"].shape[2]
        den = np.maximum(np.asarray(batch.den, np.float32), np.float32(1.0))
        weight, group = np.asarray(batch.row_weight, np.float32), np.asarray(batch.group, np.int32)
        windows = (item_windows(rows["length"], mb, T, ucfg.length_buckets, ucfg.length_grid) if "length" in rows
                   else np.full((S, R // mb), T))
        shapes = (pack_shapes(T, mb, ucfg.length_buckets, share=ucfg.share_prefix > 0, grid=ucfg.length_grid)
                  if ucfg.packing else ())
        carry, role_st = None, None
        for s in range(S):
            for m in range(R // mb):
                sl = slice(m * mb, (m + 1) * mb)
                w = weight[s, sl]
                if not np.any(w > 0):  # padding only
                    continue
                r = {k: v[s, sl] for k, v in rows.items()}
                if ucfg.packing:
                    p, t = shapes[int(r["pack_shape"].max())]
                    kind = ("pack", p, t)
                else:
                    t = int(windows[s, m])
                    kind = ("window", t)
                # Columns past the window are never read: the program's shape does not depend on T.
                r["tokens"], r["valid"] = r["tokens"][:, :min(t, T)], r["valid"][:, :min(t, T)]
                r, w_, grp, cot = put((r, w, group[s, sl], w / den[s]))
                slot = put(np.int32(s), rows_first=False)
                num, gr, st = fns["item"](state.trainable, base, r, w_, grp, slot, cot, kind=kind, T=min(t, T), W=W)
                if carry is None:
                    carry = fns["start"](state.trainable, st, S)
                carry = fns["accumulate"](carry, num, gr, st, slot, put(group[s, sl], rows_first=False))
        if carry is None:  # no trained row at all (rare): the fused program handles the empty batch
            return fallback(state, base, batch, (0,) if ucfg.packing else None)
        acc, num_total, mixed, role_st = carry
        return fns["finish"](state, acc, num_total, mixed, role_st, put(den, rows_first=False))

    fn = fallback = fused_jit if mesh is None else _sharded_jit(fused, mesh, rules)
    if ucfg.program in ("auto", "items"):
        def items_step(state, base, batch):
            if ucfg.packing and batch.pack_shape is None:
                batch = pack_batch(batch, ucfg.micro_batch, ucfg.length_buckets, ucfg.share_prefix, ucfg.length_grid)
            return itemwise(state, base, batch)
        # compiled item programs so far
        items_step.item_programs = lambda: programs["item"]._cache_size() if programs else 0
        return items_step

    if not ucfg.packing:
        return fn

    def packed_step(state, base, batch):
        if batch.pack_shape is None:
            batch = pack_batch(batch, ucfg.micro_batch, ucfg.length_buckets, ucfg.share_prefix, ucfg.length_grid)
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
