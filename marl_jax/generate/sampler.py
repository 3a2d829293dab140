"""Batched sampling for rollouts: `Sampler.generate(params, prompts, key, sp)` gives one completion per
token prompt, with its tokens' log-probs.

The work is split three ways, each in its own module:
  - marl_jax.generate.programs: the jitted programs (chunked prefill, the decode loop, row moves) and the
    sampling state;
  - marl_jax.generate.kv: the KV memory (dense cache, paged pool and its blocks, the KV budget, the prefix
    cache);
  - marl_jax.generate.scheduler: the host's decisions (continuous batching, compaction, admission under the KV
    budget and the token cap, preemption by recompute).
This module ties them together: the call's prompt layout, prefill of admitted rows, harvesting finished rows.
None of the speed or memory options changes what is sampled (tests compare each way against the other and
greedy decoding against transformers' generate).
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.generate.kv import KVMemory, PrefixCache, paged_first_pool  # noqa: F401 (also re-exported)
from marl_jax.generate.prefill import PREFILL_CHUNK
from marl_jax.generate.programs import (DecodeState, Programs, SampleOutput, SamplingParams,  # noqa: F401
                                        _batch_bucket, _next_smaller_bucket, length_bucket, resume_slots,
                                        sample_tokens)
from marl_jax.generate.scheduler import Scheduler, schedule_row_steps  # noqa: F401
from marl_jax.models import sharding
from marl_jax.models.decoder import ModelConfig, PagedCache
from marl_jax.models.sharding import to_host


def _shared_prefix_len(prompts: Sequence[Sequence[int]], minimum: int = 16) -> int:
    """Length of the prefix every prompt shares, rounded down to a length bucket (so few programs compile)
    and leaving each prompt at least one token of its own (its last token's logits start decoding).
    0 when there is one prompt or the shared part is under `minimum` tokens."""
    if len(prompts) < 2:
        return 0
    n = min(len(p) for p in prompts) - 1
    first = prompts[0]
    for p in prompts[1:]:
        n = next((j for j in range(n) if p[j] != first[j]), n)
    if n < minimum:
        return 0
    b = minimum
    while length_bucket(b + 1, minimum) <= n:
        b = length_bucket(b + 1, minimum)
    return b


class Sampler(Scheduler, KVMemory, Programs):
    """Generates completions for a list of token prompts.

    Parameters are arguments of the jitted programs (never closed over), so updating them does not
    recompile. `trainable` (optional, see marl_jax.policy.lora) has a leading slot axis; `slot`
    picks one by a traced index, so sampling another role's slot reuses the same program.

    `continuous` (refill finished rows with waiting prompts; off: chunks of max_batch rows, each run to its
    end), `compaction`, `share_prefix` (prefill a prefix all distinct prompts share once) and the prefix cache
    (`prefix_cache_tokens` > 0: keys and values of earlier calls' prompts and completions, reused by later
    prompts that extend them; see PrefixCache) only save work, and `paged` (a paged KV cache of `kv_block`-slot
    blocks) only saves memory; turning them off gives the same completions (tests compare both ways), and so does
    `prefill_chunk` (prompts prefilled in chunks of at most this many tokens: the bound on prefill memory).
    Compaction moves a tail down through 2 batch sizes per octave (2^k, 3 * 2^k) as its rows finish; a tail
    that has decoded `compaction_patience` steps without reaching the next size (its live rows are the long
    ones) is compacted onto the finer grid of `compaction_buckets` sizes per octave (2^k (1 + i / buckets)).
    Over 40 draws of the long-tail benchmark's lengths (schedule_row_steps) the coarse grid alone gives 0.886
    useful row-steps per computed one on average (0.741 at worst), 8 sizes per octave everywhere 0.975 with
    2.5x the compactions (23 a call against 9.3: decode programs to compile), and the patience rule (16, 64)
    0.973 (0.949) with 10.2 compactions. compaction_buckets=2 is the coarse grid only. `stats` holds the last
    call's counts: prefill and decode seconds, rows,
    prompt tokens computed and found cached, row-steps computed and useful (tokens decoded), refills,
    compactions, peak decode-cache bytes (paged: the pool as allocated, the blocks held by rows, pool grows).
    """

    def __init__(self, cfg: ModelConfig, *, dtype=jnp.float32, max_batch: int = 256, pad_id: int = 0,
                 spec=None, mesh=None, compaction: bool = True, min_batch: int = 8, share_prefix: bool = True,
                 rules=None, prefix_cache_tokens: int = 8192, prefix_block: int = 16, continuous: bool = True,
                 paged: bool = False, kv_block: int = 16, compaction_buckets: int = 16,
                 compaction_patience: int = 64, prefill_chunk: int = PREFILL_CHUNK, kv_budget_bytes: int = 0,
                 max_batched_tokens: int = 0, check_blocks: bool = False, kv_dtype=None):
        from marl_jax.policy.lora import PolicySpec

        self.cfg = cfg
        self.spec = spec or PolicySpec()
        self.lora_scale = self.spec.scale
        self.dtype = dtype
        # Keys and values are stored in kv_dtype (default: the compute dtype) and read back in the compute dtype:
        # bfloat16 halves the KV cache under float32 compute, and the TPU paged-attention kernel needs it.
        self.kv_dtype = jnp.dtype(kv_dtype or dtype)
        self.max_batch = max_batch
        self.pad_id = pad_id
        self.mesh = mesh
        self.rules = rules  # logical axis rules (marl_jax.models.sharding); None: the default table
        self.compaction = compaction
        self.continuous = continuous
        self.share_prefix = share_prefix
        if kv_block < 1:
            raise ValueError(f"kv_block must be >= 1, got {kv_block}")
        if kv_budget_bytes < 0 or max_batched_tokens < 0:
            raise ValueError(f"kv_budget_bytes and max_batched_tokens must be >= 0 (0 = off), got "
                             f"{kv_budget_bytes}, {max_batched_tokens}")
        # A KV budget fixes the paged pool's size: rows are admitted while their blocks fit and preempted
        # (recomputed later) when it runs dry, so the budget needs the paged cache.
        self.kv_budget_bytes, self.max_batched_tokens = int(kv_budget_bytes), int(max_batched_tokens)
        self.paged, self.kv_block = paged or self.kv_budget_bytes > 0, kv_block
        self.check_blocks = check_blocks  # tests: check the pool's bookkeeping at every host step
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        # A refill's prefill shares max_batched_tokens with the running rows: no chunk is longer.
        self.prefill_chunk = min(prefill_chunk, max_batched_tokens) if max_batched_tokens else prefill_chunk
        if compaction_buckets < 1:
            raise ValueError(f"compaction_buckets must be >= 1, got {compaction_buckets}")
        if compaction_patience < 1:
            raise ValueError(f"compaction_patience must be >= 1, got {compaction_patience}")
        self.per_octave = compaction_buckets  # the fine grid: batch sizes per octave for a long tail
        self.coarse = min(2, compaction_buckets)  # the grid compaction moves down through as rows finish
        self.patience = compaction_patience
        self.data_size = sharding.row_count(mesh)  # rows are split over data x fsdp
        self.min_batch = max(min_batch, self.data_size)
        self.stats: dict[str, Any] = {}
        self._fns: dict[Any, Any] = {}
        self.prefix_cache = (PrefixCache(cfg, -(-prefix_cache_tokens // prefix_block), prefix_block, self.kv_dtype)
                             if prefix_cache_tokens > 0 else None)

    def generate(self, params, prompts: Sequence[Sequence[int]], key: jax.Array, sp: SamplingParams, *,
                 max_new_tokens: Sequence[int] | None = None, trainable=None, slot: int = 0) -> SampleOutput:
        """Sample one completion per prompt. `max_new_tokens` optionally limits rows individually."""
        n = len(prompts)
        if n == 0:
            z = np.zeros((0, sp.max_new_tokens))
            return SampleOutput(z.astype(np.int32), z.astype(np.float32), np.zeros(0, np.int32), np.zeros(0, bool))
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token (add a BOS or chat header)")
        limits = np.full(n, sp.max_new_tokens, np.int32) if max_new_tokens is None else \
            np.minimum(np.asarray(max_new_tokens, np.int32), sp.max_new_tokens)
        out = SampleOutput(np.full((n, sp.max_new_tokens), self.pad_id, np.int32),
                           np.zeros((n, sp.max_new_tokens), np.float32), np.zeros(n, np.int32), np.zeros(n, bool))
        self._stops, self._limits = tuple(sp.stop_ids), limits
        self.stats = {"prefill_rows": 0, "prefill_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "decode_steps": 0, "row_steps": 0, "compactions": 0, "fine_compactions": 0,
                      "refills": 0, "stored_tokens": 0, "peak_kv_bytes": 0, "peak_prefill_distinct": 0,
                      "peak_prefill_rows": 0}
        if self.paged:
            self.stats.update(peak_kv_live_bytes=0, pool_grows=0, preemptions=0, recomputed_tokens=0,
                              recomputed_prompt_tokens=0, resumed_rows=0, resume_prefills=0)
        if self.prefix_cache is not None:
            self.prefix_cache.bind(params, trainable)
        self._prompts = prompts
        # Longest prompts first, so each chunk's prompt bucket is tight.
        order = np.argsort([-len(p) for p in prompts], kind="stable")
        # Continuous batching runs every row through one batch of at most max_batch rows, refilled as rows
        # finish; otherwise each chunk of max_batch rows runs to its end before the next starts.
        chunk = n if self.continuous else self.max_batch
        for start in range(0, n, chunk):
            idx = order[start:start + chunk]
            self._generate_chunk(params, [prompts[i] for i in idx], idx, key, sp, limits[idx], trainable, slot, out)
        self.stats["useful_row_steps"] = int(np.maximum(out.lengths - 1, 0).sum())
        return out

    def _plan(self, prompts, slot_id: int) -> dict:
        """The prompt layout of a call (shared by every prefill of its rows, so they share programs and the
        completion's first slot P): distinct prompts, their cached blocks, the cached region C, rest S."""
        uniq = list(dict.fromkeys(tuple(p) for p in prompts))
        # Prompts extending an earlier call's sequences load those keys and values from the prefix cache.
        pc = self.prefix_cache
        hits = {p: pc.lookup(slot_id, p) for p in uniq} if pc is not None else {}
        if pc is not None:
            pc.pinned = {b for bs in hits.values() for b in bs}
        cached = {p: len(b) * pc.block for p, b in hits.items()} if pc is not None else {}
        # Otherwise, a prefix all distinct prompts share (a role's system prompt and instructions) is
        # prefilled once per prefill.
        C, prefix = 0, ()
        if any(cached.values()):
            C = length_bucket(max(cached.values()))
        else:
            hits, cached = {}, {}
            if self.share_prefix:
                C = _shared_prefix_len(uniq)
                cached, prefix = {p: C for p in uniq}, uniq[0][:C]
        # The prompt region P as a whole is a length bucket (not C + a bucket): P sets the shapes of the
        # decode programs (the cache window P + Tn), so a step whose prompts share a longer prefix reuses them.
        S = length_bucket(C + max(len(p) - cached.get(p, 0) for p in uniq)) - C
        return dict(hits=hits, cached=cached, C=C, S=S, P=C + S, prefix=prefix)

    def _prefill(self, params, trainable, slot, plan, sp, Tn, prompts, row_ids, limits, B, key, cache_len=None,
                 gens=None):
        """Prefill `prompts` (rows row_ids) into a fresh state of B rows laid out by `plan`, with a dense cache
        of cache_len slots (default: the prompt and every new token; the paged path takes the prompt only).
        gens (or None): per row, None or the (tokens, log-probs) it generated before it was preempted; those
        rows' tokens but the last are prefilled after the prompt (the cache then needs P + G slots)."""
        n = len(prompts)
        uniq: dict[tuple, int] = {}
        expand = np.zeros(B, np.int32)
        for i, p in enumerate(prompts):  # identical prompts (the G episodes of a task) are prefilled once
            expand[i] = uniq.setdefault(tuple(p), len(uniq))
        # The distinct prompts at their own bucketed count (not min_batch: one long prompt is one row).
        Bu = _batch_bucket(len(uniq), 1, self.data_size)
        C, S, cached, hits, pc = plan["C"], plan["S"], plan["cached"], plan["hits"], self.prefix_cache
        tokens = np.full((Bu, S), self.pad_id, np.int32)
        valid = np.zeros((Bu, S), bool)
        offset = np.zeros(Bu, np.int32)
        src = np.full((Bu, C), -1, np.int32) if hits else None
        for p, u in uniq.items():
            h = cached.get(p, 0)
            tokens[u, S - len(p) + h:] = p[h:]
            valid[u, S - len(p) + h:] = True
            offset[u] = h
            for j, b in enumerate(hits.get(p, ())):
                src[u, j * pc.block:(j + 1) * pc.block] = b * pc.block + np.arange(pc.block)
        valid[len(uniq):, -1] = True  # filler rows: one dummy token so their softmax is well defined
        pool = (pc.k, pc.v, jnp.asarray(src)) if hits else None
        resume, G = None, 0
        if gens is not None and any(x is not None for x in gens):
            g = np.zeros(B, np.int32)
            prev_t = np.full((B, Tn), self.pad_id, np.int32)
            prev_l = np.zeros((B, Tn), np.float32)
            for i, x in enumerate(gens):
                if x is not None:
                    g[i] = len(x[0])
                    prev_t[i, :g[i]], prev_l[i, :g[i]] = x
            G = resume_slots(int(g.max()))
            resume = (jnp.asarray(prev_t[:, :G]), jnp.asarray(prev_t), jnp.asarray(prev_l), jnp.asarray(g))
        rid = np.full(B, -1, np.int32)
        rid[:n] = row_ids
        max_len = np.zeros(B, np.int32)
        max_len[:n] = limits
        t0 = time.perf_counter()
        state = self._prefill_fn(sp, cache_len or plan["P"] + Tn, Tn)(
            params, trainable, jnp.int32(slot), jnp.asarray(np.asarray(plan["prefix"], np.int32)), jnp.asarray(tokens),
            jnp.asarray(valid), jnp.asarray(offset), jnp.asarray(expand), jnp.asarray(max_len), jnp.asarray(rid),
            key, pool, resume)
        jax.block_until_ready(state.token)
        self.stats["prefill_s"] += time.perf_counter() - t0
        self.stats["prefill_rows"] += len(uniq)
        # The dense caches this prefill built (distinct prompts, then every row): what marl_jax.plan counts.
        self.stats["peak_prefill_distinct"] = max(self.stats["peak_prefill_distinct"], Bu)
        self.stats["peak_prefill_rows"] = max(self.stats["peak_prefill_rows"], B)
        self.stats["prefill_tokens"] += len(plan["prefix"]) + sum(len(p) - cached.get(p, 0) for p in uniq)
        if resume is not None:  # preempted rows computed again: their prompts (once per distinct one) and tokens
            gen_tokens = sum(len(x[0]) - 1 for x in gens if x is not None)
            again = sum(len(p) - cached.get(p, 0) for p in {tuple(p) for p, x in zip(prompts, gens) if x is not None})
            self.stats["prefill_tokens"] += gen_tokens
            self.stats["recomputed_tokens"] += gen_tokens + again
            self.stats["recomputed_prompt_tokens"] += again
            self.stats["resumed_rows"] += sum(x is not None for x in gens)
            self.stats["resume_prefills"] += 1
        self.stats["prompt_tokens"] += sum(len(p) for p in uniq)
        if hits:
            self.stats["cached_tokens"] += sum(cached.get(p, 0) for p in uniq)
        # Where each row's prompt tokens sit in the cache: its first `cached` tokens at slots [0, cached),
        # the rest ending at slot P (completion token t goes to slot P + t).
        for r, p in zip(row_ids, prompts):
            self._layout[int(r)] = (cached.get(tuple(p), 0), plan["P"])
        return state

    def _admit(self, params, trainable, slot, plan, sp, Tn, prompts, row_ids, limits, dest, state, key, gens=None):
        """Paged: prefill `prompts` (a dense cache of the prompt slots only, and of the tokens preempted rows had
        generated, `gens`), give each row blocks of its shard for the slots it fills, and write the rows into batch
        rows `dest` of the running state."""
        P, n = plan["P"], len(prompts)
        gens = gens if gens is not None else [None] * n
        glen = [0 if x is None else len(x[0]) for x in gens]
        G = resume_slots(max(glen)) if any(glen) else 0
        Bg = _batch_bucket(n, 1, self.data_size)
        new = self._prefill(params, trainable, int(slot), plan, sp, Tn, prompts, row_ids, limits, Bg, key,
                            cache_len=P + G, gens=gens + [None] * (Bg - n))
        c = state.cache
        B, M, D = state.active.shape[0], c.table.shape[1], c.shards
        shard = np.asarray(dest) // (B // D)
        spans = [self._spans(p, M, g) for p, g in zip(prompts, glen)]
        need = self._admission_need(shard, prompts, spans, D)[-1]
        fresh = {(int(d), tuple(p), int(j)) for d, p, js in zip(shard, prompts, spans) for j in js
                 if j < self._shared_blocks(p) and j not in self._shared.get((int(d), tuple(p)), {})}
        state = self._ensure_blocks(state, need)
        c = state.cache
        lists = self._free_lists(c)
        table = np.zeros((Bg, M), np.int32)
        write = np.zeros((Bg, M), np.int32)  # blocks this call fills (not those earlier rows filled and hold)
        for u, (d, p, js) in enumerate(zip(shard, prompts, spans)):
            d = int(d)
            key_p = (d, tuple(p))
            mine = self._shared.setdefault(key_p, {})
            for j in js:
                if j >= self._shared_blocks(p):  # the row's own block
                    table[u, j] = write[u, j] = lists[d].pop()
                    continue
                if j not in mine:
                    mine[j] = lists[d].pop()
                    self._block_key[(d, mine[j])] = key_p
                if (d, tuple(p), int(j)) in fresh:  # filled by this call's prefill (identical for every row)
                    write[u, j] = mine[j]
                table[u, j] = mine[j]
                self._refs[(d, mine[j])] = self._refs.get((d, mine[j]), 0) + 1
        state = state._replace(cache=self._with_free(c, lists))
        to = np.full(Bg, B, np.int32)
        to[:n] = dest
        sh = np.zeros(Bg, np.int32)
        sh[:n] = shard
        return self._paged_insert_fn()(state, new, jnp.asarray(to), jnp.asarray(table), jnp.asarray(write),
                                       jnp.asarray(sh))

    def _harvest(self, state: DecodeState, out: SampleOutput, slot: int = 0, final: bool = False):
        """Copy the results of every real row that finished (every real row when `final`) to the host output,
        and their keys and values to the prefix cache; a harvested row's place can then be reused (paged:
        its blocks go back to the pool). Returns the state."""
        rid = to_host(state.row_id)
        done = (rid >= 0) & (np.ones_like(rid, bool) if final else ~to_host(state.active))
        toks = to_host(state.out_tokens)[done]
        lps = to_host(state.out_logp)[done]
        steps = to_host(state.step)[done]
        rows = rid[done]
        Tn_out = out.tokens.shape[1]
        # A row's length: up to and including its stop token, capped by its limit and its step count.
        stops = np.isin(toks, np.asarray(self._stops)) if self._stops else np.zeros(toks.shape, bool)
        for j, r in enumerate(rows):
            hit = np.flatnonzero(stops[j, :steps[j]])
            length = hit[0] + 1 if len(hit) else int(steps[j])
            length = min(length, int(self._limits[r]), Tn_out)
            out.tokens[r, :length] = toks[j, :length]
            out.logprobs[r, :length] = lps[j, :length]
            out.tokens[r, length:] = self.pad_id
            out.logprobs[r, length:] = 0.0
            out.lengths[r] = length
            out.finished[r] = bool(len(hit)) and hit[0] < length
        if self.prefix_cache is not None:
            self._store(state, slot, [(int(b), int(r)) for b, r in zip(np.flatnonzero(done), rows)], out)
        if isinstance(state.cache, PagedCache) and not final:
            state = self._release(state, done)
        return state

    def _store(self, state: DecodeState, slot: int, rows: list[tuple[int, int]], out: SampleOutput):
        """Copy the full blocks of finished rows' sequences (prompt and completion but its last token, which
        was never fed back) into the prefix cache: one gather-scatter program per bucket of token count."""
        pc = self.prefix_cache
        src_row, src_slot, dst = [], [], []
        taken: set = set()
        for b, r in rows:
            prompt = list(self._prompts[r])
            n = int(out.lengths[r])
            seq = prompt + out.tokens[r, :n - 1].tolist()
            cached, P = self._layout[r]
            for start, block in pc.reserve(slot, seq, taken):
                j = np.arange(start, start + pc.block)
                if isinstance(state.cache, PagedCache):  # compacted: token j in slot j
                    slots = j
                else:
                    slots = np.where(j < cached, j, np.where(j < len(prompt), P - len(prompt) + j, P + j - len(prompt)))
                src_row += [b] * pc.block
                src_slot += slots.tolist()
                dst += (block * pc.block + np.arange(pc.block)).tolist()
        if not dst:
            return
        m = length_bucket(len(dst), 256)
        pad = m - len(dst)
        pc.ensure()
        idx = [jnp.asarray(np.asarray(a + [f] * pad, np.int32)) for a, f in
               ((src_row, 0), (src_slot, 0), (dst, pc.num_blocks * pc.block))]
        pc.k, pc.v = self._store_fn()(pc.k, pc.v, state.cache, *idx)
        self.stats["stored_tokens"] += len(dst)
