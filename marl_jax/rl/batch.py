"""Host-side layout of trajectory rows into the update's fixed-shape, slot-major arrays.

Each row is prompt + completion tokens, right-padded to T. Rows are grouped by slot into
[S, R, T] (R = the largest slot's row count rounded up to a bucket, padding rows carry weight 0).
The loss only needs the positions that predict completion tokens, so target-aligned arrays
(targets, loss_mask, old_logp) cover a window of W positions starting at each row's `win_start`
(= prompt length - 1): the LM head then runs on W positions, not on the whole (long) prompt.

Rows whose advantage is zero add exactly nothing to the policy-gradient numerator, so when no KL or
entropy term is active they are left out of the arrays; the per-slot denominator `den` is still
counted over every trained row, so the loss and its gradient are unchanged.

Every row also carries a diagnostic group index: one group per (role, call index) when copy
alignment is measured, else per role; the update measures each group's gradient exactly. With
`align_groups` each group starts on a micro-batch boundary, so every micro-batch holds one group and
its single backward pass is that group's gradient: per-group gradients then cost nothing extra.

Rows are sorted by length (longest first) within each group (or slot), so that the rows of one
micro-batch have similar lengths; each row's token count is in `length`, and the update runs each
micro-batch over a token window just long enough for its longest row (rl.update.length_ladder), not
over the whole batch's T. The loss is a sum of per-row terms, so the order of rows changes nothing
but floating-point summation order.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple, Sequence

import numpy as np

from marl_jax.generate.buckets import length_bucket


class TrainBatch(NamedTuple):
    tokens: np.ndarray  # [S, R, T] int32
    valid: np.ndarray  # [S, R, T] bool: real (non-padding) tokens
    win_start: np.ndarray  # [S, R] int32: position predicting the first completion token
    targets: np.ndarray  # [S, R, W] int32: completion tokens
    loss_mask: np.ndarray  # [S, R, W] float32: 1 on real completion tokens
    old_logp: np.ndarray  # [S, R, W] float32: their sampling log-probs
    advantages: np.ndarray  # [S, R] float32
    row_weight: np.ndarray  # [S, R] float32: 1 real row, 0 padding (or an untrained row)
    group: np.ndarray  # [S, R] int32: diagnostic group, -1 on padding
    kl_coef: np.ndarray  # [S, R] float32: per-role KL coefficient of each row
    den: np.ndarray  # [S] float32: the loss denominator of each slot, over all its trained rows
    # [S, R] int32: real tokens of each row (prompt + completion), 0 on padding; None: every row counts as
    # T long (the update then runs every micro-batch over all T)
    length: np.ndarray | None = None
    # Sequence packing (rl.update.pack_batch fills these when UpdateConfig.packing is on; None otherwise):
    # [S, R] int32 each: the packed sequence of its micro-batch that a row is laid in, the offset it starts
    # at there, and its micro-batch's (packed sequences, token window) shape as an index into
    # rl.update.pack_shapes (the same value on every row of a micro-batch).
    pack_seq: np.ndarray | None = None
    pack_off: np.ndarray | None = None
    pack_shape: np.ndarray | None = None
    # With UpdateConfig.share_prefix: [S, R] int32 each, where the row's shared prefix copy starts in its
    # packed sequence and how many of its first tokens are read from there (0: none shared).
    pack_pre: np.ndarray | None = None
    pack_share: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """Static description of the diagnostic groups (host side)."""

    names: tuple[str, ...]  # "role" or "role#call"
    role: tuple[str, ...]  # role of each group
    slot: tuple[int, ...]  # slot of each group
    roles: tuple[str, ...]  # distinct roles, in workflow order


def _round_up(n: int, multiple: int) -> int:
    return max(multiple, -(-n // multiple) * multiple)


def rows_bucket(n: int, micro_batch: int) -> int:
    """Rows per slot: a power-of-two number of micro-batches, so few shapes ever compile."""
    m = -(-max(n, 1) // micro_batch)
    return micro_batch * (1 << (m - 1).bit_length())


def make_groups(roles: Sequence[str], role_to_slot: dict[str, int], copies: dict[str, int] | None) -> GroupInfo:
    """Groups for the gradient diagnostics; `copies[role]` > 1 splits that role by call index."""
    names, g_role, g_slot = [], [], []
    for r in roles:
        k = (copies or {}).get(r, 1)
        for c in range(k):
            names.append(r if k == 1 else f"{r}#{c}")
            g_role.append(r)
            g_slot.append(role_to_slot[r])
    return GroupInfo(tuple(names), tuple(g_role), tuple(g_slot), tuple(roles))


def group_of(info: GroupInfo, role: str, call_index: int) -> int:
    name = f"{role}#{call_index}"
    if name in info.names:
        return info.names.index(name)
    if role in info.names:
        return info.names.index(role)
    # More calls than the copies declared (e.g. eval_opt turns): fold into the role's last group.
    idx = [i for i, r in enumerate(info.role) if r == role]
    if not idx:
        raise KeyError(f"role {role!r} is not one of the workflow's roles {info.roles}")
    return idx[min(call_index, len(idx) - 1)]


def slot_denominators(rows: Sequence, role_to_slot: dict[str, int], num_slots: int, agg: str) -> np.ndarray:
    """Per-slot loss denominators over trained rows (same definitions as rl.loss.policy_loss_denominator)."""
    den = np.zeros(num_slots, np.float32)
    for r in rows:
        if not getattr(r, "trained", True):
            continue
        n = len(r.completion_tokens)
        s = role_to_slot[r.role]
        if agg == "token-mean":
            den[s] += n
        elif agg == "seq-mean-token-mean":
            den[s] += 1.0 if n > 0 else 0.0
        else:
            den[s] += 1.0
    return den


def make_batch(rows: Sequence, advantages: np.ndarray, *, role_to_slot: dict[str, int], num_slots: int,
               groups: GroupInfo, micro_batch: int, pad_id: int = 0, max_len: int | None = None,
               kl_coef: dict[str, float] | None = None, agg: str = "seq-mean-token-mean",
               keep_zero_advantage: bool = False, align_groups: bool = True,
               sort_by_length: bool = True, width: int | None = None, seq_len: int | None = None) -> TrainBatch:
    """Lay rows out by slot. Rows with `trained=False` count nowhere (no gradient, not in `den`).

    keep_zero_advantage: keep rows whose advantage is 0 (needed when a KL or entropy term is on).
    align_groups: start each diagnostic group on a micro-batch boundary (the update's diagnostics
    need it; without diagnostics it only adds padding).
    sort_by_length: order rows longest first within each group (or slot, without align_groups), so
    micro-batches are tight; False keeps the rows' order.
    width: the completion window W is at least this (the sampling limit), and T at least the longest prompt
    + W: every step then has the same W and T (within the prompts' bucket) and reuses the update's compiled
    programs, where a step whose completions all stop early would otherwise compile them again.
    seq_len: T is this (the config's longest possible row, marl_jax.plan.update_lengths), unless a row is
    longer: every step then has one T, and the update's programs come from one set (rl.layout.update_shapes).
    """
    if len(rows) != len(advantages):
        raise ValueError(f"{len(rows)} rows but {len(advantages)} advantages")
    den = slot_denominators(rows, role_to_slot, num_slots, agg)
    per_slot: list[list[int]] = [[] for _ in range(num_slots)]
    for i, r in enumerate(rows):
        if getattr(r, "trained", True) and (keep_zero_advantage or advantages[i] != 0) and r.completion_tokens:
            per_slot[role_to_slot[r.role]].append(i)
    n_tok = lambda i: len(rows[i].prompt_tokens) + len(rows[i].completion_tokens)
    if sort_by_length and not align_groups:
        per_slot = [sorted(p, key=lambda i: -n_tok(i)) for p in per_slot]  # stable: ties keep their order
    kept = [rows[i] for p in per_slot for i in p]
    row_group = {i: group_of(groups, rows[i].role, rows[i].call_index) for p in per_slot for i in p}
    # Position of each kept row within its slot (None = padding): groups start on micro-batch boundaries.
    layout: list[list[int | None]] = []
    for p in per_slot:
        if not align_groups:
            layout.append(list(p))
            continue
        lay: list[int | None] = []
        for g in sorted({row_group[i] for i in p}):
            members = [i for i in p if row_group[i] == g]
            if sort_by_length:
                members.sort(key=lambda i: -n_tok(i))
            lay += members + [None] * (_round_up(len(members), micro_batch) - len(members))
        layout.append(lay)
    lengths = [len(r.prompt_tokens) + len(r.completion_tokens) for r in kept] or [1]
    T = length_bucket(max(lengths), minimum=64)
    W = length_bucket(max([len(r.completion_tokens) for r in kept] + [width or 1]), minimum=16)
    if max_len is not None and T > max_len:
        raise ValueError(f"a row has {max(lengths)} tokens but update.max_seq_len is {max_len}; "
                         "raise it or lower the sampling lengths")
    if seq_len and kept:  # the run's T; a longer row (a prompt past the config's) takes its own bucket
        T = max(T, seq_len)
    elif width and kept:  # as long as every row could be, unless that passes max_len
        stable = length_bucket(max(len(r.prompt_tokens) for r in kept) + W, minimum=64)
        if max_len is None or stable <= max_len:
            T = max(T, stable)
    R = rows_bucket(max(len(p) for p in layout), micro_batch)
    S = num_slots
    b = TrainBatch(
        tokens=np.full((S, R, T), pad_id, np.int32), valid=np.zeros((S, R, T), bool),
        length=np.zeros((S, R), np.int32),
        win_start=np.zeros((S, R), np.int32),
        targets=np.full((S, R, W), pad_id, np.int32), loss_mask=np.zeros((S, R, W), np.float32),
        old_logp=np.zeros((S, R, W), np.float32), advantages=np.zeros((S, R), np.float32),
        row_weight=np.zeros((S, R), np.float32), group=np.full((S, R), -1, np.int32),
        kl_coef=np.zeros((S, R), np.float32), den=den)
    for s, idxs in enumerate(layout):
        for j, i in enumerate(idxs):
            if i is None:
                continue
            r = rows[i]
            p, c = list(r.prompt_tokens), list(r.completion_tokens)
            seq = p + c
            n = len(seq)
            b.tokens[s, j, :n] = seq
            b.valid[s, j, :n] = True
            b.length[s, j] = n
            # Position t predicts token t+1: completion token k sits at len(p)+k, predicted at len(p)+k-1.
            b.win_start[s, j] = len(p) - 1
            b.targets[s, j, : len(c)] = c
            b.loss_mask[s, j, : len(c)] = 1.0
            b.old_logp[s, j, : len(c)] = np.asarray(r.logprobs, np.float32)
            b.advantages[s, j] = advantages[i]
            b.row_weight[s, j] = 1.0
            b.group[s, j] = row_group[i]
            b.kl_coef[s, j] = (kl_coef or {}).get(r.role, 0.0)
    return b
