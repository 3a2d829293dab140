"""Host-side layout of the update: which rows each work item holds and the token shape it runs over.

An update step runs work items one after another, each a group of rows of one slot (and, with
diagnostics, of one diagnostic group) run as one program (marl_jax.rl.update). This module decides,
on the host and in NumPy, everything about those items that shapes their programs:

  - length windows: each item runs over a token window just long enough for its longest row, one of
    `length_ladder`'s sizes (few sizes, so few programs over a run);
  - packing: an item's rows laid end to end in fewer sequences (`pack_shapes`, `pack_batch`), optionally
    over one copy of a prefix they share (`share_units`, `pack_units`);
  - micro-batches: a fixed number of rows (UpdateConfig.micro_batch: the batch's own [S, R] layout cut
    into slices, `fixed_items`) or as many rows as a token budget holds (`budget_items`, verl's dynamic
    batch size), with row counts and windows on the same grid so that programs stay few.

Nothing here changes a value the update computes: every row's loss terms are the same over any window
that holds it, packed or not (tests/test_update_layout.py, tests/test_token_budget.py).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from marl_jax.rl.batch import TrainBatch


# ---- length windows ----

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


def grid_size(n: int, grid: int = 2) -> int:
    """The smallest size >= n on length_ladder's grid, extended below 8 (1, 2, 3, 4, 6, 8, 12, ... at grid 2):
    the row counts a token budget's items are padded to."""
    if n <= 1:
        return 1
    k = 1 << ((n - 1).bit_length() - 1)  # the largest power of two below n
    return next(v for v in (-(-k * (grid + i) // grid) for i in range(1, grid + 1)) if v >= n)


def item_windows(length, micro_batch: int, T: int, n: int, grid: int = 2):
    """Host-side: the token window each (slot, micro-batch) item of a batch runs over, as the update
    chooses it ([S, M]; 0 for items of padding only, which are skipped). length: the batch's [S, R]
    row lengths; T: its padded length; n: UpdateConfig.length_buckets."""
    length = np.asarray(length)
    S, R = length.shape
    mb = min(micro_batch, R)
    longest = length.reshape(S, R // mb, mb).max(-1)
    ladder = np.asarray(length_ladder(T, n, grid))
    which = np.minimum(np.searchsorted(ladder, longest, side="left"), len(ladder) - 1)
    return np.where(longest > 0, ladder[which], 0)


# ---- packing ----

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
    length); rows alone have shared length 0. The grouping saves the most tokens, sum of (members - 1) x
    shared length, over the rows' prefix tree: at each branch point either every row below shares the
    branch's prefix, or each subtree is grouped on its own (ties go to the subtrees: smaller units pack
    more freely). A greedy leader would not do: in a GRPO batch every prompt shares a short chat-template
    head, and one unit over it would take the rows whose group shares the whole prompt. Units and their
    rows come longest first."""
    live = [i for i in range(len(lengths)) if lengths[i] > 0]
    if not live:
        return []
    n_of = lambda i: int(lengths[i])
    order = sorted(live, key=lambda i: tuple(tokens[i, :n_of(i)].tolist()))
    # lcp[k]: common prefix of order[k] and order[k + 1]; a range's common prefix is its minimum
    lcp = [_common_prefix(tokens[a], tokens[b], min(n_of(a), n_of(b))) for a, b in zip(order, order[1:])]

    # Bottom-up over the tree of common-prefix intervals (a stack, no recursion: prefix chains can be deep).
    stack, node = [], None  # open intervals [shared length, first row, tokens saved, units]; node: [lo, saved, units]
    for k in range(len(order)):
        node = [k, 0, [([order[k]], 0)]]
        h = lcp[k] if k < len(lcp) else -1
        while stack and stack[-1][0] > h:  # intervals that end at row k: close them
            c, lo, saved, units = stack.pop()
            saved, units = saved + node[1], units + node[2]
            whole = (k - lo) * c
            node = [lo, whole, [(order[lo:k + 1], c)]] if c >= minimum and whole > saved else [lo, saved, units]
        if h < 0:
            break
        if stack and stack[-1][0] == h:
            stack[-1][2] += node[1]
            stack[-1][3] += node[2]
        else:
            stack.append([h, node[0], node[1], node[2]])

    longest = lambda rows: sorted(rows, key=lambda i: (-n_of(i), i))
    units = [(longest(rows), c) for rows, c in node[2]]
    return sorted(units, key=lambda u: (-n_of(u[0][0]), u[0][0]))


def _unit_parts(rows, c: int, lengths, capacity: int) -> list[tuple[list[int], int, int]]:
    """A shared-prefix unit cut, in its rows' order, into parts that each fit one sequence of `capacity`
    tokens: (rows, shared length, tokens); every part has its own copy of the prefix, a row alone shares none."""
    part = lambda rs: (rs, c, c + sum(int(lengths[i]) - c for i in rs)) if len(rs) > 1 else (
        rs, 0, int(lengths[rs[0]]))
    parts, cur, size = [], [], c
    for i in rows:
        n = int(lengths[i]) - c
        if n + c > capacity:
            raise ValueError(f"a row of {n + c} tokens does not fit a packed sequence of {capacity}")
        if cur and size + n > capacity:
            parts.append(part(cur))
            cur, size = [], c
        cur.append(i)
        size += n
    parts.append(part(cur))
    return parts


def _first_fit(part, lengths, capacity: int, fill: list[int], where: dict) -> None:
    """Lay one part in the first sequence with room for it (a new one if none has): fill (tokens used per
    sequence) and where (row -> (sequence, prefix offset, offset, shared length)) are updated in place."""
    rows, c, size = part
    j = next((j for j, f in enumerate(fill) if f + size <= capacity), len(fill))
    if j == len(fill):
        fill.append(0)
    at, start = fill[j] + c, fill[j]
    for i in rows:
        where[i] = (j, start, at - c, c)
        at += int(lengths[i]) - c
    fill[j] += size


def pack_units(units, lengths, capacity: int) -> tuple[dict[int, tuple[int, int, int, int]], int]:
    """First-fit decreasing of shared-prefix units into sequences of `capacity` tokens: each row's
    (sequence, prefix offset, offset, shared length) with its token q >= shared length at offset + q and
    q < shared length at prefix offset + q; and the number of sequences used. A unit too long for one
    sequence is split, each part with its own copy of the prefix."""
    parts = [p for rows, c in units for p in _unit_parts(rows, c, lengths, capacity)]
    where, fill = {}, []
    for part in sorted(parts, key=lambda u: -u[2]):
        _first_fit(part, lengths, capacity, fill, where)
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


# ---- work items ----

class Item(NamedTuple):
    """One work item: rows of one slot run as one program."""

    slot: int
    rows: np.ndarray  # [n] int: the item's rows within its slot; -1: a padding row (row counts are bucketed)
    kind: tuple  # ("window", t): rows over their first t tokens; ("pack", p, t): laid in p sequences of t
    # The rows' packing ([n] each: pack_seq, pack_off, and with shared prefixes pack_pre, pack_share) when
    # the item was packed on its own (token budget); None: read from the batch (TrainBatch.pack_*)
    pack: dict | None = None

    @property
    def positions(self) -> int:
        """Token positions the item's forward pass computes."""
        return self.kind[1] * self.kind[2] if self.kind[0] == "pack" else len(self.rows) * self.kind[1]


def fixed_items(weight, windows, pack_shape, shapes, micro_batch: int) -> list[Item]:
    """Items of micro_batch rows each, the batch's [S, R] layout cut in slices, slot-major; slices of
    padding only (weight 0) are skipped. windows: item_windows' [S, M]; pack_shape: the batch's [S, R]
    (TrainBatch.pack_shape) with shapes its pack_shapes, or None unpacked."""
    S, R = weight.shape
    out = []
    for s in range(S):
        for m in range(R // micro_batch):
            sl = slice(m * micro_batch, (m + 1) * micro_batch)
            if not np.any(weight[s, sl] > 0):
                continue
            kind = (("pack",) + tuple(shapes[int(pack_shape[s, sl].max())]) if pack_shape is not None
                    else ("window", int(windows[s, m])))
            out.append(Item(s, np.arange(sl.start, sl.stop), kind))
    return out


def _budget_windows(lens, budget: int, ladder, grid: int) -> list[tuple[list[int], int, int]]:
    """Rows (sorted longest first) cut into micro-batches of at most `budget` computed positions, each as
    (rows, row count it compiles, window): a micro-batch's window is its longest row's, it holds up to
    budget // window rows, its row count is padded up to the grid, and those padding slots take the next
    (shorter) rows, which then cost nothing. A row whose window exceeds the budget runs alone."""
    ladder = np.asarray(ladder)
    win = ladder[np.minimum(np.searchsorted(ladder, lens, side="left"), len(ladder) - 1)]
    out, i = [], 0
    while i < len(lens):
        w = int(win[i])
        cap = max(1, budget // w)
        j = i + 1
        while j < len(lens) and j - i < cap and win[j] == w:
            j += 1
        n = min(grid_size(j - i, grid), cap)
        j = min(i + n, len(lens))
        out.append((list(range(i, j)), n, w))
        i = j
    return out


def _budget_packs(units, lens, budget: int, ladder, W: int, grid: int, head_over_rows: bool = True):
    """Units (sorted longest first) laid into micro-batches of packed sequences, at most `budget` positions
    each: budget // window sequences of one window, units taken first fit in order (one that no longer fits
    waits for the next micro-batch). The window holds the longest row left and, within the budget, the
    largest unit left (its prefix laid once); a unit longer than the window is split first, each part with
    its own copy of the prefix. With head_over_rows a micro-batch also stops at `budget` scored positions
    (rows x min(W, window): the LM head runs on each row's completion window; without, the head runs on the
    completion tokens alone, which its packed positions already bound). Each as (rows, where (row -> sequence, prefix offset,
    offset, shared), sequences used, window); only a row whose window exceeds the budget makes a micro-batch
    over it (alone, with what fits beside it in its sequence)."""
    ladder = np.asarray(ladder)
    win = lambda n: int(ladder[min(np.searchsorted(ladder, n), len(ladder) - 1)])
    size = lambda u: u[1] + sum(int(lens[i]) - u[1] for i in u[0]) if len(u[0]) > 1 else int(lens[u[0][0]])
    out, left = [], list(units)
    while left:
        t, big = win(max(int(lens[i]) for u in left for i in u[0])), win(max(size(u) for u in left))
        if big > t:  # a longer window lays more of a unit over one prefix copy, up to the budget
            t = max([t] + [int(w) for w in ladder if w <= min(big, budget)])
        cap = max(1, budget // t)
        fill, where, taken, rest = [], {}, [], []
        for part in (p for u in left for p in _unit_parts(u[0], u[1], lens, t)):
            rows, c, _ = part
            f, wh = list(fill), {}
            _first_fit(part, lens, t, f, wh)
            head_ok = not head_over_rows or grid_size(len(taken) + len(rows), grid) * min(W, t) <= budget
            if not taken or (len(f) <= cap and head_ok):
                fill, taken = f, taken + list(rows)
                where.update(wh)
            else:
                rest.append((rows, c))
        out.append((taken, where, len(fill), t))
        left = rest
    return out


def budget_items(length, weight, group, *, budget: int, T: int, W: int, grid: int = 2, by_group: bool = True,
                 packing: bool = False, tokens=None, share_prefix: int = 0, head_over_rows: bool = True) -> list[Item]:
    """Items holding as many rows as a token budget allows (verl's use_dynamic_bsz): per slot, and with
    by_group per diagnostic group, its rows (weight > 0) longest first are cut into micro-batches of at most
    `budget` computed positions: rows x window unpacked, sequences x window packed (see _budget_windows,
    _budget_packs). Windows come from length_ladder's whole grid up to T (budget // window bounds each
    window's row count, so the programs stay few; packed over shared prefixes also 2T, as pack_shapes), row
    and sequence counts are padded to the same grid.

    A row whose window is longer than the budget gets a micro-batch of its own, over that window: its
    values are exact and the rollout already held it, so it is run rather than refused.
    length: [S, R] tokens per row (prompt + completion); weight, group: [S, R]; tokens [S, R, T] (only with
    share_prefix); W: the batch's completion window; head_over_rows: see _budget_packs."""
    length, weight, group = np.asarray(length), np.asarray(weight), np.asarray(group)
    tokens = np.asarray(tokens) if share_prefix else None
    ladder = length_ladder(T, T, grid)
    pack_ladder = ladder + ((2 * T,) if share_prefix else ())  # as pack_shapes: a unit over its prefix may exceed T
    out = []
    for s in range(length.shape[0]):
        live = np.flatnonzero(weight[s] > 0)
        keys = group[s, live] if by_group else np.zeros(len(live), np.int64)
        for g in np.unique(keys):
            idx = live[keys == g]
            idx = idx[np.argsort(-length[s, idx], kind="stable")]
            lens = length[s, idx]
            if not packing:
                for rows, n, w in _budget_windows(lens, budget, ladder, grid):
                    out.append(Item(s, np.pad(idx[rows], (0, n - len(rows)), constant_values=-1), ("window", w)))
                continue
            units = (share_units(tokens[s, idx], lens, share_prefix) if share_prefix
                     else [([i], 0) for i in range(len(idx))])
            for rows, where, used, t in _budget_packs(units, lens, budget, pack_ladder, W, grid, head_over_rows):
                p = min(grid_size(used, grid), max(1, budget // t))  # used is 1 when a row's window is over budget
                # rows cost little when the head skips their windows: powers of two, fewer programs
                n = grid_size(len(rows), grid if head_over_rows else 1)
                pack = {k: np.zeros(n, np.int32) for k in ("pack_seq", "pack_pre", "pack_off", "pack_share")}
                for a, i in enumerate(rows):
                    for k, v in zip(("pack_seq", "pack_pre", "pack_off", "pack_share"), where[i]):
                        pack[k][a] = v
                if not share_prefix:
                    del pack["pack_pre"], pack["pack_share"]
                out.append(Item(s, np.pad(idx[rows], (0, n - len(rows)), constant_values=-1), ("pack", p, t), pack))
    return out


def plan_items(batch: TrainBatch, *, micro_batch: int, length_buckets: int, grid: int = 2, packing: bool = False,
               share_prefix: int = 0, max_tokens: int = 0, by_group: bool = True,
               head_over_rows: bool = True) -> list[Item]:
    """Host-side: the work items of a batch in the order the update runs them: fixed micro-batches of
    micro_batch rows (max_tokens 0; a packed layout needs the batch packed, pack_batch) or micro-batches
    of a token budget (budget_items)."""
    weight = np.asarray(batch.row_weight)
    S, R, T = batch.tokens.shape
    if batch.length is not None:
        length = np.asarray(batch.length)
    elif packing:
        raise ValueError("packing needs the rows' lengths (TrainBatch.length)")
    else:
        length = None
    if max_tokens:
        return budget_items(np.where(weight > 0, T, 0) if length is None else length, weight, np.asarray(batch.group),
                            budget=max_tokens, T=T, W=batch.targets.shape[2], grid=grid, by_group=by_group,
                            packing=packing, tokens=batch.tokens if share_prefix else None,
                            share_prefix=share_prefix, head_over_rows=head_over_rows)
    mb = min(micro_batch, R)
    windows = (item_windows(length, mb, T, length_buckets, grid) if length is not None
               else np.full((S, R // mb), T))
    shapes = pack_shapes(T, mb, length_buckets, share=share_prefix > 0, grid=grid) if packing else ()
    return fixed_items(weight, windows, np.asarray(batch.pack_shape) if packing else None, shapes, mb)


def take_rows(x: np.ndarray, rows: np.ndarray, fill=0) -> np.ndarray:
    """x[rows] along the first axis, `fill` where rows is -1 (padding rows)."""
    out = x[np.maximum(rows, 0)]
    pad = (rows < 0).reshape((-1,) + (1,) * (out.ndim - 1))
    return np.where(pad, np.asarray(fill, out.dtype), out) if (rows < 0).any() else out
