"""The sampler's scheduler, on the host: which rows decode, when the loop stops for the host, who is admitted
and who is preempted (vLLM's core/sched/scheduler.py is the model). It decides; marl_jax.generate.programs
computes; marl_jax.generate.kv holds the memory.

Continuous batching: a call's rows (any number) go through one batch of at most `max_batch` rows (vLLM's
max_num_seqs). Each row counts its own tokens and writes its own cache slot, so when an eighth of the rows have
finished the loop exits, the host harvests them and prefills waiting rows into their places. When nothing
waits, the tail is compacted: once the live rows fit the next smaller batch bucket, the host gathers them into
it (and a long tail onto a finer grid after `compaction_patience` steps). Attention reads a window of the cache
(a quarter, a half, then all of the new-token slots) so early steps skip the cache's empty end.

Admission and preemption under a KV budget: a refill admits waiting rows, in order, while their blocks fit the
pool (keeping the blocks the running rows take on their next step and a 1% watermark) and, with
`max_batched_tokens`, while their prompt tokens and the running rows' decode tokens fit that cap. When the pool
cannot serve the next decode step, the last admitted row of the short shard is preempted by recompute: its
tokens and log-probs so far stay on the host, its blocks go back, and it waits at the front of the queue to be
prefilled again from prompt + generated tokens. Sampling is keyed per (row, token index), so a preempted row
yields exactly the tokens it would have yielded. A row that cannot fit the whole pool alone is refused before
anything is sampled.
"""
from __future__ import annotations

import collections
import time
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from marl_jax.generate.programs import DecodeState, SampleOutput, _batch_bucket, _next_smaller_bucket, length_bucket
from marl_jax.models.sharding import to_host


def schedule_row_steps(limits: Sequence[int], max_batch: int, min_batch: int = 8, multiple: int = 1,
                       per_octave: int = 16, patience: int = 64) -> dict[str, int]:
    """The dense, single-shard continuous-batching schedule of Sampler.generate replayed on host for rows that
    decode `limits` tokens each (in the order the sampler takes them: longest prompt first), with
    compaction_buckets=per_octave and compaction_patience=patience. Returns row_steps (batch rows x decode
    steps), useful (tokens decoded after the first), compactions (fine: those onto the fine grid), refills
    and batch_sizes (distinct decode batch sizes). Tests hold it to the sampler's own counts; it prices a
    compaction setting over many draws of a length distribution without running a model."""
    lim = np.asarray(limits, np.int64)
    n = len(lim)
    coarse = min(2, per_octave)
    B = _batch_bucket(min(n, max_batch), min_batch, multiple)
    first = min(n, B)
    left = np.zeros(B, np.int64)  # decode steps each row still takes (the prefill samples its first token)
    left[:first] = np.maximum(lim[:first] - 1, 0)
    waiting, row_steps, comps, fines, refills, sizes, phase = first, 0, 0, 0, 0, {B}, 0
    while True:
        budget = None
        if waiting < n:
            exit_at = B - max(1, B // 8)
        else:
            exit_at = _next_smaller_bucket(B, min_batch, multiple, coarse)
            if per_octave > coarse:
                budget = max(patience - phase, 1)
        if int((left > 0).sum()) > exit_at:  # decode until at most exit_at rows are live (or the budget ends)
            steps = int(np.sort(left)[::-1][exit_at])
            steps = steps if budget is None else min(steps, budget)
            row_steps += steps * B
            left = np.maximum(left - steps, 0)
            phase += steps if waiting >= n else 0
        live_rows = left > 0
        live = int(live_rows.sum())
        if waiting >= n and not live:
            break
        fine = live > exit_at and phase >= patience and per_octave > coarse
        if fine:
            fine = _batch_bucket(live, min_batch, multiple, per_octave) < B
            phase = phase if fine else 0
        if live > exit_at and not fine:
            continue
        if waiting < n:
            free = np.flatnonzero(~live_rows)
            take = min(len(free), n - waiting)
            left[free[:take]] = np.maximum(lim[waiting:waiting + take] - 1, 0)
            waiting += take
            refills += 1
            continue
        newB = _batch_bucket(live, min_batch, multiple, per_octave if fine else coarse)
        left = np.concatenate([left[live_rows], np.zeros(newB - live, np.int64)])
        B, comps, fines, phase = newB, comps + 1, fines + fine, 0
        sizes.add(B)
    return dict(row_steps=row_steps, useful=int(np.maximum(lim - 1, 0).sum()), compactions=comps,
                fine_compactions=fines, refills=refills, batch_sizes=len(sizes))


class Scheduler:
    """A Sampler's host loop over one chunk of rows: decode, harvest, refill, compact, preempt."""

    def _generate_chunk(self, params, prompts, row_ids, key, sp, limits, trainable, slot, out: SampleOutput):
        slot_id = int(slot)
        Tn = length_bucket(sp.max_new_tokens)
        plan = self._plan(prompts, slot_id)
        P = plan["P"]
        self._layout = {}
        self._gens: dict[int, tuple] = {}  # local index -> (tokens, log-probs) of a preempted row, until it resumes
        self._admitted: dict[int, int] = {}  # global row id -> admission order (the last admitted is preempted first)
        self._local = {int(r): i for i, r in enumerate(row_ids)}
        B = _batch_bucket(min(len(prompts), self.max_batch), self.min_batch, self.data_size)
        queue = collections.deque(range(len(prompts)))  # rows not started, preempted ones in front
        if self.paged:  # an empty paged state, then the first rows go in as a refill would put them
            state = self._empty_paged(B, P, Tn, sp, prompts[:B])
            if self.kv_budget_bytes:
                self._refuse_oversized(prompts, limits, plan, state)
            state, _ = self._refill(params, trainable, slot, plan, sp, Tn, prompts, row_ids, limits, queue,
                                    np.arange(B), state, key)
        else:
            first = min(len(prompts), B)
            state = self._prefill(params, trainable, slot, plan, sp, Tn, prompts[:first], row_ids[:first],
                                  limits[:first], B, key)
            for _ in range(first):
                queue.popleft()
        slot = jnp.int32(slot)
        t0 = time.perf_counter()
        stuck = None  # paged over several shards: live rows that could not be compacted (one shard too full)
        blocked = False  # the KV budget left waiting rows out: decode until a row finishes and frees blocks
        phase = 0  # tail steps decoded since the batch last changed size
        big = np.iinfo(np.int32).max
        while True:
            B = state.active.shape[0]
            if self.paged and self.kv_budget_bytes:  # preempt the last admitted rows if the next step lacks blocks
                state = self._make_room(state, queue)
            active = to_host(state.active)
            steps = np.where(active, to_host(state.step), 1)
            budget = big
            if queue:  # exit to refill once an eighth of the rows are free
                exit_at = B - max(1, B // 8)
                if blocked:
                    exit_at = min(exit_at, int(active.sum()) - 1)
            elif self.compaction:  # exit to compact once the live rows fit the next smaller (coarse) bucket
                exit_at = _next_smaller_bucket(B, self.min_batch, self.data_size, self.coarse)
                if stuck is not None:
                    exit_at = min(exit_at, stuck - 1)
                if self.per_octave > self.coarse:  # or after `patience` steps, to fit the long rows tightly
                    budget = max(self.patience - phase, 1)
            else:
                exit_at = 0
            if active.sum() > exit_at:
                window = next(w for w in self._windows(P, Tn) if w >= P + steps.max())
                if self.paged:
                    window = min(-(-window // self.kv_block) * self.kv_block, state.cache.valid.shape[1])
                    state = self._ensure_blocks(state, self._blocks_wanted(state))
                state, it = self._decode_fn(sp, P, window)(params, trainable, slot, state, key, jnp.int32(exit_at),
                                                           jnp.int32(budget))
                self._count_kv(state)  # after decode: the most blocks held since the last exit
                active = to_host(state.active)
                self.stats["decode_steps"] += int(it)
                self.stats["row_steps"] += int(it) * B
                if not queue:
                    phase += int(it)
            if self.check_blocks and self.paged:
                self._check_blocks(state)
            if not active.any() and not queue:
                self._harvest(state, out, slot_id, final=True)
                if self.paged:
                    self._check_blocks(state)
                break
            fine = (self.compaction and active.sum() > exit_at and phase >= self.patience
                    and self.per_octave > self.coarse)
            if fine:  # a long tail: compact onto the fine grid if it holds a smaller batch
                fine = _batch_bucket(int(active.sum()), self.min_batch, self.data_size, self.per_octave) < B
                phase = 0 if not fine else phase
            if active.sum() > exit_at and not fine:
                continue  # only the window moved (or the block pool needs to grow, or rows must be preempted)
            state = self._harvest(state, out, slot_id)
            if queue:
                # Refill: waiting rows take the finished rows' places, as many as the KV budget holds.
                t1 = time.perf_counter()
                state, taken = self._refill(params, trainable, slot, plan, sp, Tn, prompts, row_ids, limits, queue,
                                            np.flatnonzero(~active), state, key)
                blocked = taken == 0
                if taken == 0 and not active.any():
                    raise RuntimeError("the KV budget holds no waiting row although no row is running "
                                       "(a bug: rows that cannot fit alone are refused before sampling)")
                t0 += time.perf_counter() - t1  # prefill time is counted apart
                self.stats["refills"] += int(taken > 0)
                continue
            # Compact: live rows first, then fillers, into the next smaller bucket.
            live = np.flatnonzero(active)
            grid = self.per_octave if fine else self.coarse
            phase = 0
            if self.paged and state.cache.shards > 1:
                idx, keep = self._compact_by_shard(active, state.cache.shards, grid)
                if idx is None:  # a shard holds too many live rows: decode on until another row finishes
                    stuck = len(live)
                    continue
                stuck, newB = None, len(idx)
            else:
                newB = _batch_bucket(len(live), self.min_batch, self.data_size, grid)
                fill = np.flatnonzero(~active)[: newB - len(live)]
                idx = np.concatenate([live, fill]).astype(np.int32)
                keep = np.arange(newB) < len(live)
            state = self._gather_fn()(state, jnp.asarray(idx), jnp.asarray(keep))
            self.stats["compactions"] += 1
            self.stats["fine_compactions"] += int(fine)
        self.stats["decode_s"] += time.perf_counter() - t0

    def _refill(self, params, trainable, slot, plan, sp, Tn, prompts, row_ids, limits, queue, free, state, key):
        """Admit rows from the front of `queue` into batch rows `free`: as many as the free rows, the token cap
        (max_batched_tokens: prompt tokens to prefill, beside one decode token per running row) and, paged under a
        KV budget, the free blocks hold (keeping the blocks the running rows take on their next step and a 1%
        watermark). Returns (state, rows admitted)."""
        n = min(len(free), len(queue))
        if n == 0:
            return state, 0
        cand = [queue[i] for i in range(n)]
        gens = [self._gens.get(i) for i in cand]
        glen = [0 if x is None else len(x[0]) for x in gens]
        if self.max_batched_tokens:
            live = int((to_host(state.row_id) >= 0).sum())
            cost = np.cumsum([len(prompts[i]) - plan["cached"].get(tuple(prompts[i]), 0) + max(g - 1, 0)
                              for i, g in zip(cand, glen)])
            n = max(1, int((cost <= self.max_batched_tokens - live).sum()))
        if self.paged and self.kv_budget_bytes:
            c = state.cache
            B, M, D = state.active.shape[0], c.table.shape[1], c.shards
            shard = np.asarray(free[:n]) // (B // D)
            spans = [self._spans(prompts[i], M, g) for i, g in zip(cand[:n], glen)]
            need = self._admission_need(shard, [prompts[i] for i in cand[:n]], spans, D)
            room = to_host(c.top) - self._blocks_wanted(state) - max(1, (c.k.shape[2] - 1) // 100)
            fits = (need <= room[None]).all(1)
            n = int(np.argmin(fits)) if not fits.all() else n  # the longest prefix that fits
        if n == 0:
            return state, 0
        take = [queue.popleft() for _ in range(n)]
        for i in take:
            self._admitted[int(row_ids[i])] = len(self._admitted)
        idx = np.asarray(take)
        sub = [prompts[i] for i in take]
        gens = [self._gens.pop(i, None) for i in take]
        if self.paged:
            state = self._admit(params, trainable, int(slot), plan, sp, Tn, sub, row_ids[idx], limits[idx],
                                free[:n], state, key, gens)
        else:
            Bg = _batch_bucket(n, 1, self.data_size)
            new = self._prefill(params, trainable, int(slot), plan, sp, Tn, sub, row_ids[idx], limits[idx], Bg, key)
            dest = np.full(Bg, state.active.shape[0], np.int32)
            dest[:n] = free[:n]
            state = self._insert_fn()(state, new, jnp.asarray(dest))
        return state, n

    def _make_room(self, state: DecodeState, queue) -> DecodeState:
        """Under a KV budget: while a shard's free blocks cannot serve its live rows' next step, preempt the row
        admitted last in that shard (vLLM's recompute preemption): its tokens and log-probs so far are kept on
        the host, its blocks go back, and it waits at the front of the queue to be prefilled again."""
        need = self._blocks_wanted(state)
        top = to_host(state.cache.top)
        if (top >= need).all():
            return state
        rid, active = to_host(state.row_id), to_host(state.active)
        D = state.cache.shards
        per = len(rid) // D
        victims = np.zeros(len(rid), bool)
        while True:
            short = np.flatnonzero(top < need)
            if not len(short):
                break
            d = int(short[0])
            rows = [b for b in range(d * per, (d + 1) * per) if rid[b] >= 0 and active[b] and not victims[b]]
            victim = max(rows, key=lambda b: self._admitted[int(rid[b])])
            victims[victim] = True
            state = self._preempt(state, victim, queue)
            need, top = self._blocks_wanted(state), to_host(state.cache.top)
        self.stats["preemptions"] += int(victims.sum())
        return state

    def _preempt(self, state: DecodeState, b: int, queue) -> DecodeState:
        r = int(to_host(state.row_id)[b])
        g = int(to_host(state.step)[b])
        self._gens[self._local[r]] = (to_host(state.out_tokens)[b, :g].copy(), to_host(state.out_logp)[b, :g].copy())
        queue.appendleft(self._local[r])
        done = np.zeros(state.active.shape[0], bool)
        done[b] = True
        return self._release(state, done)

    def _refuse_oversized(self, prompts, limits, plan, state: DecodeState):
        """A row whose prompt and completion need more blocks than the budget's pool holds would never run:
        refuse the call before sampling, naming the knobs."""
        c = state.cache
        M, N = c.table.shape[1], c.k.shape[2]
        worst = max(len(self._spans(p, M, int(n))) for p, n in zip(prompts, limits))
        usable = N - 1 - max(1, (N - 1) // 100)  # block 0 is the null block; admission keeps a 1% watermark
        if worst > usable:
            per = self._block_bytes()
            raise ValueError(
                f"one row needs {worst} KV blocks ({worst * per / 2**30:.3f} GiB: its prompt and up to "
                f"{int(max(limits))} new tokens) but the KV budget holds {usable} "
                f"({self.kv_budget_bytes / 2**30:.3f} GiB per device): raise --config.rollout.kv_budget_gb to at "
                f"least {(worst + 2) * per / 2**30 * 1.02:.3f}, or lower --config.rollout.max_new_tokens or the "
                "prompt's length")

    def _compact_by_shard(self, active: np.ndarray, D: int, per_octave: int = 2):
        """Compaction that keeps every row in its shard (its blocks are there): (idx, keep) into the next
        bucket whose shards hold each shard's live rows, or (None, None) when no smaller bucket does."""
        B = len(active)
        per = active.reshape(D, B // D)
        newB = _batch_bucket(max(int(per.sum(1).max()) * D, int(active.sum())), self.min_batch, D, per_octave)
        if newB >= B:
            return None, None
        idx = []
        for d in range(D):
            rows = d * (B // D) + np.concatenate([np.flatnonzero(per[d]), np.flatnonzero(~per[d])])
            idx.append(rows[: newB // D])
        idx = np.concatenate(idx).astype(np.int32)
        return idx, active[idx]

    @staticmethod
    def _windows(P: int, Tn: int) -> tuple[int, ...]:
        """Attention windows (cache slots attended) for prompt bucket P: a quarter, a half and all of the
        new tokens, so early steps, where most row-steps are, skip the cache's empty end. Each window is
        a decode program to compile, so they are used only where the new tokens are most of the cache
        (long completions after short prompts); otherwise the one window is the whole cache."""
        if Tn < max(64, P):
            return (P + Tn,)
        return (P + Tn // 4, P + Tn // 2, P + Tn)
