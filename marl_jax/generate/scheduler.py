"""The sampler's scheduler, on the host: which rows decode, when the decode loop stops for the host, who is
admitted and who is preempted (vLLM's core/sched/scheduler.py is the model). It decides; the rows it drives
(marl_jax.generate.sampler's device rows, or `SimulatedRows` here) act; the paged pool's bookkeeping is its
BlockPool (marl_jax.generate.block_pool).

Continuous batching: a call's rows (any number) go through one batch of at most `max_batch` rows (vLLM's
max_num_seqs). Each row counts its own tokens and writes its own cache slot, so when an eighth of the rows have
finished the loop exits, the host harvests them and prefills waiting rows into their places. When nothing
waits, the tail is compacted: once the live rows fit the next smaller batch bucket, the host gathers them into
it (and a long tail onto a finer grid after `patience` steps).

Admission and preemption under a KV budget: a refill admits waiting rows, in order, while their blocks fit the
pool (keeping the blocks the running rows take on their next step and a 1% watermark) and, with
`max_batched_tokens`, while their prompt tokens and the running rows' decode tokens fit that cap. When the pool
cannot serve the next decode step, the last admitted row of the short shard is preempted by recompute: its
tokens and log-probs so far stay on the host, its blocks go back, and it waits at the front of the queue to be
prefilled again from prompt + generated tokens. Sampling is keyed per (row, token index), so a preempted row
yields exactly the tokens it would have yielded.

`Scheduler.run` is the one decision loop: the sampler runs it over the device, `schedule_row_steps` over
simulated rows (to price a compaction setting without a model), with the same decisions.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Protocol, Sequence

import numpy as np

from marl_jax.generate import buckets
from marl_jax.generate.block_pool import BlockPool


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 256  # rows decoded at once
    min_batch: int = 8  # smallest batch bucket
    shards: int = 1  # devices rows are split over (batch sizes are multiples of it)
    compaction: bool = True
    per_octave: int = 16  # the fine grid for a long tail (compaction_buckets)
    patience: int = 64  # tail steps before the fine grid
    max_batched_tokens: int = 0  # prompt tokens a refill prefills beside the running rows (0: no cap)
    check_blocks: bool = False  # tests: check the pool's bookkeeping at every host step

    @property
    def coarse(self) -> int:
        """The grid compaction moves down through as rows finish (2 sizes per octave)."""
        return min(2, self.per_octave)

    def first_batch(self, n: int) -> int:
        return buckets.batch_bucket(min(n, self.max_batch), self.min_batch, self.shards)


class View(NamedTuple):
    """The host's copy of the running batch: per batch row, live, tokens generated, position of its last
    token, and which of the call's rows it holds (-1: none); the block tables when paged."""
    active: np.ndarray
    step: np.ndarray
    pos: np.ndarray
    row: np.ndarray
    table: np.ndarray | None = None


class Rows(Protocol):
    """What the scheduler drives: a batch of rows that decodes, and the moves between its host steps."""

    def view(self) -> View: ...

    def decode(self, exit_at: int, max_steps: int) -> int:
        """Decode until at most exit_at rows are live or max_steps steps have run; the steps run."""

    def harvest(self, final: bool) -> None:
        """Finished rows (every row when final) out; their batch rows become free."""

    def admit(self, rows: Sequence[int], slots: np.ndarray) -> None:
        """Prefill call rows `rows` (preempted ones from their tokens so far) into batch rows `slots`."""

    def compact(self, idx: np.ndarray, keep: np.ndarray) -> None:
        """The batch becomes rows idx of itself; those with keep False are fillers."""

    def preempt(self, slot: int) -> int:
        """Batch row `slot` gives up its place and blocks, keeping its tokens; returns how many it had."""


class Scheduler:
    """The decisions of one sampler call over rows whose prompts are `prompts`: (key, length) per row, rows with
    one key sharing that prompt (its tokens as a tuple, in the sampler); `cached[i]`: tokens of row i's prompt
    found in the prefix cache, not prefilled. `pool`: the paged pool's bookkeeping, or None (dense)."""

    def __init__(self, config: SchedulerConfig, prompts: Sequence[tuple], pool: BlockPool | None = None,
                 cached: Sequence[int] | None = None, batch: int = 0):
        self.config, self.prompts, self.pool = config, list(prompts), pool
        # The first batch: sized for the call's rows, or for more (a config's fixed shapes: buckets.CallShape)
        self.batch = config.first_batch(max(len(prompts), batch))
        self.cached = list(cached) if cached is not None else [0] * len(prompts)
        self.queue = collections.deque(range(len(prompts)))  # rows not started, preempted ones in front
        self.generated: dict[int, int] = {}  # row -> tokens it had when preempted, until it resumes
        self.admitted: dict[int, int] = {}  # row -> admission order (the last admitted is preempted first)
        self.stats = dict(decode_steps=0, row_steps=0, compactions=0, fine_compactions=0, refills=0, preemptions=0)
        self.sizes: set[int] = set()

    @property
    def budgeted(self) -> bool:
        return self.pool is not None and self.pool.fixed

    def run(self, rows: Rows):
        """The decision loop: decode, harvest, refill, compact, preempt, until every row has finished."""
        c = self.config
        B = self.batch
        self.sizes.add(B)
        self.refill(rows, np.arange(B))
        stuck = None  # paged over several shards: live rows that could not be compacted (one shard too full)
        blocked = False  # the KV budget left waiting rows out: decode until a row finishes and frees blocks
        phase = 0  # tail steps decoded since the batch last changed size
        while True:
            if self.budgeted:
                self.make_room(rows)
            v = rows.view()
            B, live = len(v.active), int(v.active.sum())
            max_steps = np.iinfo(np.int32).max
            if self.queue:  # exit to refill once an eighth of the rows are free
                exit_at = B - max(1, B // 8)
                if blocked:
                    exit_at = min(exit_at, live - 1)
            elif c.compaction:  # exit to compact once the live rows fit the next smaller (coarse) bucket
                exit_at = buckets.next_smaller_bucket(B, c.min_batch, c.shards, c.coarse)
                if stuck is not None:
                    exit_at = min(exit_at, stuck - 1)
                if c.per_octave > c.coarse:  # or after `patience` steps, to fit the long rows tightly
                    max_steps = max(c.patience - phase, 1)
            else:
                exit_at = 0
            if live > exit_at:
                it = rows.decode(exit_at, max_steps)
                self.stats["decode_steps"] += it
                self.stats["row_steps"] += it * B
                if not self.queue:
                    phase += it
                v = rows.view()
                live = int(v.active.sum())
            if c.check_blocks and self.pool is not None:
                self.pool.check(v.table)
            if not live and not self.queue:
                if self.pool is not None:
                    self.pool.check(v.table)
                rows.harvest(final=True)
                return
            fine = c.compaction and live > exit_at and phase >= c.patience and c.per_octave > c.coarse
            if fine:  # a long tail: compact onto the fine grid if it holds a smaller batch
                fine = buckets.batch_bucket(live, c.min_batch, c.shards, c.per_octave) < B
                phase = phase if fine else 0
            if live > exit_at and not fine:
                continue  # only the window moved (or the block pool needs to grow, or rows must be preempted)
            rows.harvest(final=False)
            if self.queue:  # refill: waiting rows take the finished rows' places, as many as the KV budget holds
                taken = self.refill(rows, np.flatnonzero(~v.active))
                blocked = taken == 0
                if taken == 0 and not live:
                    raise RuntimeError("the KV budget holds no waiting row although no row is running "
                                       "(a bug: rows that cannot fit alone are refused before sampling)")
                self.stats["refills"] += int(taken > 0)
                continue
            # Compact: live rows first, then fillers, into the next smaller bucket.
            grid = c.per_octave if fine else c.coarse
            phase = 0
            if self.pool is not None and self.pool.shards > 1:
                idx, keep = compact_by_shard(v.active, self.pool.shards, c.min_batch, grid)
                if idx is None:  # a shard holds too many live rows: decode on until another row finishes
                    stuck = live
                    continue
                stuck = None
                rows.compact(idx, keep)
            else:
                # Down the grid one size at a time (live rows first, then fillers): each size has one or two
                # successors, so the compactions a call can run are a short list (Sampler.warmup compiles it)
                newB = buckets.batch_bucket(live, c.min_batch, c.shards, grid)
                b = buckets.next_smaller_bucket(B, c.min_batch, c.shards, grid)
                fill = np.flatnonzero(~v.active)[: b - live]
                idx = np.concatenate([np.flatnonzero(v.active), fill]).astype(np.int32)
                rows.compact(idx, np.arange(b) < live)
                while b > newB:
                    self.sizes.add(b)
                    b = buckets.next_smaller_bucket(b, c.min_batch, c.shards, grid)
                    idx = np.arange(b, dtype=np.int32)
                    rows.compact(idx, idx < live)
            self.sizes.add(len(idx))
            self.stats["compactions"] += 1
            self.stats["fine_compactions"] += int(fine)

    def refill(self, rows: Rows, free: np.ndarray) -> int:
        """Admit rows from the front of the queue into batch rows `free`: as many as the free rows, the token cap
        (max_batched_tokens: prompt tokens to prefill, beside one decode token per running row) and, under a KV
        budget, the free blocks hold (keeping the blocks the running rows take on their next step and a
        watermark). Returns the rows admitted."""
        c, pool = self.config, self.pool
        n = min(len(free), len(self.queue))
        if n == 0:
            return 0
        cand = [self.queue[i] for i in range(n)]
        glen = [self.generated.get(i, 0) for i in cand]
        if c.max_batched_tokens:
            running = int((rows.view().row >= 0).sum())
            cost = np.cumsum([self.prompts[i][1] - self.cached[i] + max(g - 1, 0) for i, g in zip(cand, glen)])
            n = max(1, int((cost <= c.max_batched_tokens - running).sum()))
        if self.budgeted:
            v = rows.view()
            B = len(v.active)
            shard = np.asarray(free[:n]) // (B // pool.shards)
            spans = [pool.spans(self.prompts[i][1], g) for i, g in zip(cand[:n], glen)]
            need = pool.admission_need(shard, [self.prompts[i] for i in cand[:n]], spans)
            room = pool.room(BlockPool.wanted(v.pos, v.active, v.table, pool.shards, pool.block))
            fits = (need <= room[None]).all(1)
            n = n if fits.all() else int(np.argmin(fits))  # the longest prefix that fits
        if n == 0:
            return 0
        take = [self.queue.popleft() for _ in range(n)]
        for i in take:
            self.admitted[i] = len(self.admitted)
        rows.admit(take, np.asarray(free[:n]))
        for i in take:
            self.generated.pop(i, None)
        return n

    def make_room(self, rows: Rows):
        """Under a KV budget: while a shard's free blocks cannot serve its live rows' next step, preempt the row
        admitted last in that shard (vLLM's recompute preemption); it waits at the front of the queue."""
        pool = self.pool
        v = rows.view()
        wanted = lambda v: BlockPool.wanted(v.pos, v.active, v.table, pool.shards, pool.block)
        need = wanted(v)
        if (pool.free_count() >= need).all():
            return
        per = len(v.active) // pool.shards
        victims = 0
        while True:
            short = np.flatnonzero(pool.free_count() < need)
            if not len(short):
                break
            d = int(short[0])
            cand = [b for b in range(d * per, (d + 1) * per) if v.row[b] >= 0 and v.active[b]]
            victim = max(cand, key=lambda b: self.admitted[int(v.row[b])])
            r = int(v.row[victim])
            self.generated[r] = rows.preempt(victim)
            self.queue.appendleft(r)
            victims += 1
            v = rows.view()
            need = wanted(v)
        self.stats["preemptions"] += victims


def compact_by_shard(active: np.ndarray, shards: int, min_batch: int, per_octave: int = 2):
    """Compaction that keeps every row in its shard (its blocks are there): (idx, keep) into the next
    bucket whose shards hold each shard's live rows, or (None, None) when no smaller bucket does."""
    B = len(active)
    per = active.reshape(shards, B // shards)
    newB = buckets.batch_bucket(max(int(per.sum(1).max()) * shards, int(active.sum())), min_batch, shards, per_octave)
    if newB >= B:
        return None, None
    idx = []
    for d in range(shards):
        rows = d * (B // shards) + np.concatenate([np.flatnonzero(per[d]), np.flatnonzero(~per[d])])
        idx.append(rows[: newB // shards])
    idx = np.concatenate(idx).astype(np.int32)
    return idx, active[idx]


class SimulatedRows:
    """Rows that decode `limits[i]` tokens each (the first sampled by the prefill), dense, no model: what
    schedule_row_steps drives the scheduler over."""

    def __init__(self, limits: Sequence[int], batch: int):
        self.limits = np.asarray(limits, np.int64)
        self.left = np.zeros(batch, np.int64)  # decode steps each batch row still takes
        self.row = np.full(batch, -1, np.int64)
        self.step = np.ones(batch, np.int64)

    def view(self) -> View:
        active = self.left > 0
        return View(active, self.step.copy(), self.step.copy(), np.where(active | (self.row >= 0), self.row, -1))

    def decode(self, exit_at: int, max_steps: int) -> int:
        steps = min(int(np.sort(self.left)[::-1][exit_at]), max_steps)
        self.step = self.step + np.minimum(self.left, steps)
        self.left = np.maximum(self.left - steps, 0)
        return steps

    def harvest(self, final: bool):
        pass

    def admit(self, rows, slots):
        self.left[slots] = np.maximum(self.limits[list(rows)] - 1, 0)
        self.row[slots] = rows
        self.step[slots] = 1

    def compact(self, idx, keep):
        self.left, self.row, self.step = self.left[idx] * keep, np.where(keep, self.row[idx], -1), self.step[idx]

    def preempt(self, slot):
        raise NotImplementedError("simulated rows are dense: nothing is preempted")


def schedule_row_steps(limits: Sequence[int], max_batch: int, min_batch: int = 8, multiple: int = 1,
                       per_octave: int = 16, patience: int = 64) -> dict[str, int]:
    """The dense continuous-batching schedule of Sampler.generate for rows that decode `limits` tokens each
    (in the order the sampler takes them: longest prompt first), with compaction_buckets=per_octave and
    compaction_patience=patience, run through the sampler's own Scheduler over simulated rows. Returns
    row_steps (batch rows x decode steps), useful (tokens decoded after the first), compactions (fine: those
    onto the fine grid), refills and batch_sizes (distinct decode batch sizes). It prices a compaction setting
    over many draws of a length distribution without running a model."""
    config = SchedulerConfig(max_batch=max_batch, min_batch=min_batch, shards=multiple, per_octave=per_octave,
                             patience=patience)
    sched = Scheduler(config, [(0, 1)] * len(limits))
    sched.run(SimulatedRows(limits, config.first_batch(len(limits))))
    s = sched.stats
    return dict(row_steps=s["row_steps"], useful=int(np.maximum(np.asarray(limits) - 1, 0).sum()),
                compactions=s["compactions"], fine_compactions=s["fine_compactions"], refills=s["refills"],
                batch_sizes=len(sched.sizes))
