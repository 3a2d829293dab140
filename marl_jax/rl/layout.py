"""Host-side layout of the update: which rows each work item holds and the token shape it runs over.

An update step runs work items one after another, each a group of rows of one slot (and, with
diagnostics, of one diagnostic group) run as one program (marl_jax.rl.update). This module decides,
on the host and in NumPy, everything about those items that shapes their programs:

  - length windows: each item runs over a token window just long enough for its longest row, one of
    `length_ladder`'s sizes (few sizes, so few programs over a run);
  - packing: an item's rows laid end to end in fewer sequences of the batch's length T (`pack_shapes`,
    `pack_batch`), optionally over one copy of a prefix they share (`share_units`, `pack_units`), in
    sequences of 2T then for fixed micro-batches (`pack_length`);
  - micro-batches: a fixed number of rows (UpdateConfig.micro_batch: the batch's own [S, R] layout cut
    into slices, `fixed_items`) or as many rows as a token budget holds (`budget_items`, verl's dynamic
    batch size), with row and sequence counts on the same grid so that programs stay few.

Every shape comes from ladders of T (the batch's padded length), W (its scored window) and the config alone,
never from a batch's rows: with T and W fixed for a run (the trainer pads every batch to the config's longest
possible row, marl_jax.plan.update_lengths) `update_shapes` lists every item program a run can compile, and
the update compiles them all before its first step (rl.update.make_train_step's warmup).

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

def grid_sizes(cap: int, grid: int = 2) -> tuple[int, ...]:
    """The counts an item pads its sequences (or rows) to: grid_size of each count up to cap, at most cap
    (1, 2, 3, 4, 6, 8 for 8 at grid 2)."""
    return tuple(sorted({min(grid_size(k, grid), cap) for k in range(1, max(cap, 1) + 1)}))


def pack_length(T: int, share: bool = False) -> int:
    """The length of a packed sequence for rows padded to T: T (rows laid end to end fill it, so a shorter one
    would save little: at most one partly filled sequence per item is padding), or 2T when rows share prefixes:
    a unit's rows lie over one copy of its prefix only within one sequence, and at T rows over a prompt longer
    than T/2 could not share at all (at 2T, three or more rows whenever the prompt is as long as a completion)."""
    return 2 * T if share else T


def pack_shapes(T: int, micro_batch: int, grid: int = 2, share: bool = False) -> tuple[tuple[int, int], ...]:
    """The (packed sequences, token window) shapes a packed micro-batch compiles: sequences of pack_length, as
    many as its rows need on the grid up to the count that holds micro_batch rows of T tokens (micro_batch,
    or half of it at 2T: first fit decreasing puts two rows or more in every sequence but its last)."""
    L = pack_length(T, share)
    return tuple((p, L) for p in grid_sizes(-(-micro_batch * T // L), grid))


def _common_prefix(a: np.ndarray, b: np.ndarray, n: int) -> int:
    d = np.flatnonzero(a[:n] != b[:n])
    return int(d[0]) if len(d) else n


class Unit(NamedTuple):
    """Rows laid over one copy of the prefix they share: its first `shared` tokens (0: a row alone)."""

    rows: list[int]
    shared: int


class Part(NamedTuple):
    """Rows of a unit that fit one packed sequence, over their own copy of the prefix."""

    rows: list[int]
    shared: int
    size: int  # tokens it takes: the prefix once, then each row's own


class Place(NamedTuple):
    """Where a row lies in the packed sequences: its token q >= shared at off + q, q < shared at pre + q."""

    seq: int
    pre: int  # where its unit's prefix copy starts
    off: int
    shared: int


def share_units(tokens: np.ndarray, lengths, minimum: int) -> list[Unit]:
    """Host-side: rows grouped into units that share a prefix of >= `minimum` tokens; rows alone have
    shared length 0. The grouping saves the most tokens, sum of (members - 1) x
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
        node = [k, 0, [Unit([order[k]], 0)]]
        h = lcp[k] if k < len(lcp) else -1
        while stack and stack[-1][0] > h:  # intervals that end at row k: close them
            c, lo, saved, units = stack.pop()
            saved, units = saved + node[1], units + node[2]
            whole = (k - lo) * c
            node = [lo, whole, [Unit(order[lo:k + 1], c)]] if c >= minimum and whole > saved else [lo, saved, units]
        if h < 0:
            break
        if stack and stack[-1][0] == h:
            stack[-1][2] += node[1]
            stack[-1][3] += node[2]
        else:
            stack.append([h, node[0], node[1], node[2]])

    longest = lambda rows: sorted(rows, key=lambda i: (-n_of(i), i))
    units = [Unit(longest(u.rows), u.shared) for u in node[2]]
    return sorted(units, key=lambda u: (-n_of(u.rows[0]), u.rows[0]))


def _unit_parts(rows, c: int, lengths, capacity: int, max_rows: int = 0) -> list[Part]:
    """A shared-prefix unit cut, in its rows' order, into parts that each fit one sequence of `capacity`
    tokens (and hold at most max_rows rows, 0: any); every part has its own copy of the prefix, a row alone
    shares none."""
    part = lambda rs: Part(rs, c, c + sum(int(lengths[i]) - c for i in rs)) if len(rs) > 1 else Part(
        rs, 0, int(lengths[rs[0]]))
    parts, cur, size = [], [], c
    for i in rows:
        n = int(lengths[i]) - c
        if n + c > capacity:
            raise ValueError(f"a row of {n + c} tokens does not fit a packed sequence of {capacity}")
        if cur and (size + n > capacity or len(cur) == max_rows):
            parts.append(part(cur))
            cur, size = [], c
        cur.append(i)
        size += n
    parts.append(part(cur))
    return parts


def _first_fit(part: Part, lengths, capacity: int, fill: list[int], where: dict) -> None:
    """Lay one part in the first sequence with room for it (a new one if none has): fill (tokens used per
    sequence) and where (row -> Place) are updated in place."""
    rows, c, size = part
    j = next((j for j, f in enumerate(fill) if f + size <= capacity), len(fill))
    if j == len(fill):
        fill.append(0)
    at, start = fill[j] + c, fill[j]
    for i in rows:
        where[i] = Place(j, start, at - c, c)
        at += int(lengths[i]) - c
    fill[j] += size


def pack_units(units, lengths, capacity: int) -> tuple[dict[int, Place], int]:
    """First-fit decreasing of shared-prefix units into sequences of `capacity` tokens: each row's Place and
    the number of sequences used. A unit too long for one sequence is split, each part with its own copy of
    the prefix."""
    parts = [p for rows, c in units for p in _unit_parts(rows, c, lengths, capacity)]
    where, fill = {}, []
    for part in sorted(parts, key=lambda u: -u.size):
        _first_fit(part, lengths, capacity, fill, where)
    return where, len(fill)


def pack_rows(lengths, capacity: int) -> tuple[list[int], list[int], int]:
    """First-fit decreasing: each row's (sequence, offset) in sequences of `capacity` tokens, and the
    number of sequences used. Rows of length 0 (padding) go nowhere (sequence 0, offset 0). pack_units
    with every row a unit of its own."""
    where, used = pack_units([Unit([i], 0) for i in range(len(lengths)) if lengths[i] > 0], lengths, capacity)
    seq, off = [0] * len(lengths), [0] * len(lengths)
    for i, place in where.items():
        seq[i], off[i] = place.seq, place.off
    return seq, off, used


def pack_batch(batch: TrainBatch, micro_batch: int, share_prefix: int = 0, grid: int = 2) -> TrainBatch:
    """Host-side: the packing of every micro-batch (TrainBatch.pack_*): its rows first fit decreasing in
    sequences of pack_length, the fewest of pack_shapes that hold them. share_prefix > 0: rows sharing a prefix
    of at least that many tokens are laid over one copy of it (share_units; TrainBatch.pack_pre / pack_share)."""
    if batch.length is None:
        raise ValueError("packing needs the rows' lengths (TrainBatch.length)")
    length = np.asarray(batch.length)
    S, R = length.shape
    T = batch.tokens.shape[2]
    mb = min(micro_batch, R)
    shapes = pack_shapes(T, mb, grid, share_prefix > 0)
    counts, L = [p for p, _ in shapes], shapes[0][1]
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
                     else [Unit([i], 0) for i in range(mb) if lens[i] > 0])
            where, used = pack_units(units, lens, L)
            # Rows are at most T long: at L = T every part holds a row; at 2T a sequence holding one row alone
            # has room for any later (shorter) part, so only the last does, and the largest count holds them.
            if used > counts[-1]:
                raise AssertionError(f"{used} packed sequences for {int((lens > 0).sum())} rows "
                                     f"(pack_shapes: {counts})")
            for i, at in where.items():
                seq[s, m * mb + i], pre[s, m * mb + i], off[s, m * mb + i], shared[s, m * mb + i] = at
            shape[s, rows] = counts.index(min(grid_size(used, grid), counts[-1]))
    return batch._replace(pack_seq=seq, pack_off=off, pack_shape=shape,
                          pack_pre=pre if share_prefix else None, pack_share=shared if share_prefix else None)


def item_positions(batch: TrainBatch, micro_batch: int, n: int, packing: bool, share_prefix: int = 0, grid: int = 2):
    """Host-side: the token positions each (slot, micro-batch) item computes ([S, M]; 0 when skipped)."""
    S, R, T = batch.tokens.shape
    mb = min(micro_batch, R)
    if not packing:
        return item_windows(batch.length, micro_batch, T, n, grid) * mb
    b = batch if batch.pack_shape is not None else pack_batch(batch, micro_batch, share_prefix, grid)
    shapes = np.asarray([p * t for p, t in pack_shapes(T, mb, grid, b.pack_share is not None)])
    live = np.asarray(b.length).reshape(S, R // mb, mb).max(-1) > 0
    return np.where(live, shapes[np.asarray(b.pack_shape)[:, ::mb]], 0)


# ---- work items ----

class Window(NamedTuple):
    """An item's shape: its rows over their first t tokens, one row per sequence."""

    t: int

    def positions(self, rows: int) -> int:
        return rows * self.t


class Packed(NamedTuple):
    """An item's shape: its rows laid end to end in p sequences of t tokens."""

    p: int
    t: int

    def positions(self, rows: int) -> int:
        return self.p * self.t


class RowPacking(NamedTuple):
    """Where a packed item's rows lie in its sequences ([n] int32 each, one entry per row of the item)."""

    seq: np.ndarray  # the sequence a row is laid in
    off: np.ndarray  # the offset its tokens start at there
    pre: np.ndarray | None = None  # shared prefixes: where the row's prefix copy starts
    share: np.ndarray | None = None  # how many of its first tokens are read from that copy (0: none)


class Item(NamedTuple):
    """One work item: rows of one slot run as one program."""

    slot: int
    rows: np.ndarray  # [n] int: the item's rows within its slot; -1: a padding row (row counts are bucketed)
    shape: Window | Packed  # what its program runs over; its program is keyed by it
    pack: RowPacking | None = None  # a Packed item's rows' places

    @property
    def positions(self) -> int:
        """Token positions the item's forward pass computes."""
        return self.shape.positions(len(self.rows))


def fixed_items(weight, windows, micro_batch: int, packed: TrainBatch | None = None, shapes=()) -> list[Item]:
    """Items of micro_batch rows each, the batch's [S, R] layout cut in slices, slot-major; slices of
    padding only (weight 0) are skipped. windows: item_windows' [S, M]; packed: the batch with its packing
    (pack_batch), whose pack_shape indexes `shapes` (its pack_shapes), or None unpacked."""
    S, R = weight.shape
    out = []
    for s in range(S):
        for m in range(R // micro_batch):
            sl = slice(m * micro_batch, (m + 1) * micro_batch)
            if not np.any(weight[s, sl] > 0):
                continue
            rows = np.arange(sl.start, sl.stop)
            if packed is None:
                out.append(Item(s, rows, Window(int(windows[s, m]))))
                continue
            at = lambda x: None if x is None else np.asarray(x)[s, sl]
            out.append(Item(s, rows, Packed(*shapes[int(np.asarray(packed.pack_shape)[s, sl].max())]),
                            RowPacking(at(packed.pack_seq), at(packed.pack_off), at(packed.pack_pre),
                                       at(packed.pack_share))))
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


# Packed items whose LM head runs on their scored positions alone hold up to budget // ROW_TOKENS rows: a row
# then costs its [T] token and [W] target columns, not positions, and the count is fixed, so one program per
# sequence count (rows shorter than this on average end an item before its sequences are full).
ROW_TOKENS = 16


def pack_window(T: int, budget: int, grid: int = 2) -> int:
    """The sequence length packed budget items use: T, or the longest grid window within a budget below T
    (a longer row then runs alone over its own window). T even when rows share prefixes (pack_length's 2T is
    for fixed micro-batches): a budget already bounds each item, and on CPU the dense attention of 2T
    sequences cost more than the positions they saved (docs/update-layouts.md)."""
    if budget >= T:
        return T
    ladder = length_ladder(T, T, grid)
    return max([w for w in ladder if w <= budget] or [ladder[0]])


def rows_cap(budget: int, t: int, W: int, head_over_rows: bool) -> int:
    """The row count every packed budget item of t-token sequences compiles at: with the LM head over each
    row's window (head_over_rows), the rows whose min(W, t) scored positions the budget holds; else
    budget // ROW_TOKENS (see ROW_TOKENS)."""
    return max(1, budget // (min(W, t) if head_over_rows else ROW_TOKENS))


def _budget_packs(units, lens, t: int, seqs: int, max_rows: int):
    """Units (sorted longest first) laid first fit into items of at most `seqs` sequences of t tokens and
    max_rows rows, in order (a part that no longer fits waits for the next item); a unit longer than a sequence
    (or than max_rows rows) is split first, each part with its own copy of the prefix. Each item as (rows,
    where (row -> Place), sequences used)."""
    out, left = [], list(units)
    while left:
        fill, where, taken, rest = [], {}, [], []
        for part in (p for u in left for p in _unit_parts(u.rows, u.shared, lens, t, max_rows)):
            f, wh = list(fill), {}
            _first_fit(part, lens, t, f, wh)
            if not taken or (len(f) <= seqs and len(taken) + len(part.rows) <= max_rows):
                fill, taken = f, taken + list(part.rows)
                where.update(wh)
            else:
                rest.append(Unit(part.rows, part.shared))
        out.append((taken, where, len(fill)))
        left = rest
    return out


def budget_items(length, weight, group, *, budget: int, T: int, W: int, grid: int = 2, by_group: bool = True,
                 packing: bool = False, tokens=None, share_prefix: int = 0, head_over_rows: bool = True,
                 length_buckets: int = 4) -> list[Item]:
    """Items holding as many rows as a token budget allows (verl's use_dynamic_bsz): per slot, and with
    by_group per diagnostic group, its rows (weight > 0) longest first are cut into micro-batches of at most
    `budget` computed positions.

    Unpacked: rows x window, windows from length_ladder's whole grid up to T (budget // window bounds each
    window's row count), row counts on the grid (_budget_windows). Packed: sequences of pack_window(T, budget)
    tokens, as many as the budget holds (their count padded to the grid), rows_cap rows each (padding rows
    fill an item's row slots: one program per sequence count); rows laid over shared prefixes with share_prefix.

    A row longer than the budget (or, packed, than the sequence length) gets a micro-batch of its own, over its
    window (packed: from length_ladder(T, length_buckets)): its values are exact and the rollout already held
    it, so it is run rather than refused.
    length: [S, R] tokens per row (prompt + completion); weight, group: [S, R]; tokens [S, R, T] (only with
    share_prefix); W: the batch's completion window; head_over_rows: the LM head runs over each row's window
    (see rows_cap)."""
    length, weight, group = np.asarray(length), np.asarray(weight), np.asarray(group)
    tokens = np.asarray(tokens) if share_prefix else None
    ladder = length_ladder(T, T, grid)
    t = pack_window(T, budget, grid)
    seqs = max(1, budget // t)
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
                    out.append(Item(s, np.pad(idx[rows], (0, n - len(rows)), constant_values=-1), Window(w)))
                continue
            long = int(np.sum(lens > t))  # rows sorted longest first: these run alone
            for i in range(long):
                w = next(x for x in length_ladder(T, length_buckets, grid) if x >= lens[i])
                n = rows_cap(budget, w, W, head_over_rows)
                pack = RowPacking(*[np.zeros(n, np.int32)] * (4 if share_prefix else 2))
                out.append(Item(s, np.pad(idx[i:i + 1], (0, n - 1), constant_values=-1), Packed(1, w), pack))
            units = (share_units(tokens[s, idx[long:]], lens[long:], share_prefix) if share_prefix
                     else [Unit([i], 0) for i in range(len(idx) - long)])
            n = rows_cap(budget, t, W, head_over_rows)
            for rows, where, used in _budget_packs(units, lens[long:], t, seqs, n):
                col = lambda f: np.asarray([getattr(where[i], f) for i in rows] + [0] * (n - len(rows)), np.int32)
                pack = RowPacking(col("seq"), col("off"), *((col("pre"), col("shared")) if share_prefix else ()))
                out.append(Item(s, np.pad(idx[long:][rows], (0, n - len(rows)), constant_values=-1),
                                Packed(min(grid_size(used, grid), seqs), t), pack))
    return out


class ItemShape(NamedTuple):
    """What an item program is compiled for (with the batch's T and W): its shape and its row count."""

    shape: Window | Packed
    rows: int


def update_shapes(T: int, W: int, *, micro_batch: int, length_buckets: int, grid: int = 2, packing: bool = False,
                  max_tokens: int = 0, head_over_rows: bool = True, share: bool = False) -> list[ItemShape]:
    """Every item shape plan_items can give a batch padded to T with a scored window W: the set a run compiles
    (rl.update's warmup compiles it before the first step; `python -m marl_jax.plan` lists it). Stated from the
    same ladders plan_items uses; tests/test_compile_once.py checks that a run's items stay within it.
    Fixed micro-batches assume the batch holds at least micro_batch rows per slot (rl.batch.rows_bucket)."""
    out = []
    if not max_tokens:
        if packing:
            return [ItemShape(Packed(p, t), micro_batch) for p, t in pack_shapes(T, micro_batch, grid, share)]
        return [ItemShape(Window(t), micro_batch) for t in length_ladder(T, length_buckets, grid)]
    if not packing:  # _budget_windows: row counts on the grid up to budget // window, for each window
        for w in length_ladder(T, T, grid):
            cap = max(1, max_tokens // w)
            out += [ItemShape(Window(w), n) for n in sorted({min(grid_size(k, grid), cap) for k in range(1, cap + 1)})]
        return out
    t = pack_window(T, max_tokens, grid)
    n = rows_cap(max_tokens, t, W, head_over_rows)
    out = [ItemShape(Packed(p, t), n) for p in grid_sizes(max(1, max_tokens // t), grid)]
    return out + [ItemShape(Packed(1, w), rows_cap(max_tokens, w, W, head_over_rows))
                  for w in length_ladder(T, length_buckets, grid) if w > t]


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
                            share_prefix=share_prefix, head_over_rows=head_over_rows, length_buckets=length_buckets)
    mb = min(micro_batch, R)
    windows = (item_windows(length, mb, T, length_buckets, grid) if length is not None
               else np.full((S, R // mb), T))
    if not packing:
        return fixed_items(weight, windows, mb)
    if batch.pack_shape is None:
        raise ValueError("packed fixed micro-batches need the batch's packing (rl.layout.pack_batch)")
    return fixed_items(weight, windows, mb, batch, pack_shapes(T, mb, grid, batch.pack_share is not None))


def take_rows(x: np.ndarray, rows: np.ndarray, fill=0) -> np.ndarray:
    """x[rows] along the first axis, `fill` where rows is -1 (padding rows)."""
    out = x[np.maximum(rows, 0)]
    pad = (rows < 0).reshape((-1,) + (1,) * (out.ndim - 1))
    return np.where(pad, np.asarray(fill, out.dtype), out) if (rows < 0).any() else out
