"""Batched sampling for rollouts: `Sampler.generate(params, prompts, key, sp)` gives one completion per
token prompt, with its tokens' log-probs.

The parts, each in its own module and composed here:
  - marl_jax.generate.programs: the jitted programs (chunked prefill, the decode loop, row moves);
  - marl_jax.generate.scheduler: the host's decisions (continuous batching, compaction, admission under the KV
    budget and the token cap, preemption by recompute), in one loop that drives `DeviceRows` here;
  - marl_jax.generate.block_pool: the paged pool's host bookkeeping (free blocks, shared prompt blocks);
  - marl_jax.generate.prefix_cache: keys and values of earlier calls' sequences;
  - marl_jax.generate.buckets, types, sampling: the sizing rules, the shared types, token sampling.
This module holds the call's prompt layout and `DeviceRows`, which carries the decode state on the device and
does what the scheduler decides (prefill and admit rows, decode, harvest finished rows, compact, preempt).
None of the speed or memory options changes what is sampled (tests compare each way against the other and
greedy decoding against transformers' generate).
"""
from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from marl_jax.generate import buckets
from marl_jax.generate.block_pool import BlockPool
from marl_jax.generate.buckets import length_bucket  # noqa: F401 (re-exported: the sampler's length rule)
from marl_jax.generate.prefill import PREFILL_CHUNK
from marl_jax.generate.prefix_cache import PrefixCache
from marl_jax.generate.programs import ProgramConfig, Programs
from marl_jax.generate.scheduler import Scheduler, SchedulerConfig, View
from marl_jax.generate.types import CallShape, DecodeState, SampleOutput, SamplingParams  # noqa: F401 (re-exported)
from marl_jax.models import attention as attn
from marl_jax.models import sharding
from marl_jax.models.decoder import ModelConfig
from marl_jax.models.sharding import to_device, to_host


_log = logging.getLogger(__name__)
_over_said: set = set()


def _over_shape(shape: CallShape, longest: int, P: int) -> None:
    """Says once per CallShape that a call's prompts outgrow it: that call compiles programs the warm-up did not."""
    if shape in _over_said:
        return
    _over_said.add(shape)
    _log.warning(f"a prompt of {longest} tokens is over the {shape.prompt} its sampler call was sized for "
                 f"(--config.rollout.prompt_tokens, plus earlier stages' completions): this call compiles programs "
                 f"for a prompt region of {P}. Raise --config.rollout.prompt_tokens by {longest - shape.prompt} "
                 f"or more to keep every call in the warm-up's programs.")


class PromptLayout(NamedTuple):
    """Where a call's prompts sit in the prefill cache (shared by every prefill of its rows, so they share
    programs and the completion's first slot P): `hits` (prompt -> prefix-cache blocks) and `cached` (prompt
    -> tokens loaded from them) with C the cached region, or a `prefix` of C tokens every prompt shares; each
    prompt's rest left-padded to S slots after C."""
    hits: dict
    cached: dict
    C: int
    S: int
    prefix: tuple

    @property
    def P(self) -> int:
        return self.C + self.S


class Sampler:
    """Generates completions for a list of token prompts.

    Parameters are arguments of the jitted programs (never closed over), so updating them does not
    recompile. `trainable` (optional, see marl_jax.policy.lora) has a leading slot axis; `slot`
    picks one by a traced index, so sampling another role's slot reuses the same program.

    `continuous` (refill finished rows with waiting prompts; off: chunks of max_batch rows, each run to its
    end), `compaction`, `share_prefix` (prefill a prefix all distinct prompts share once) and the prefix cache
    (`prefix_cache_tokens` > 0: keys and values of earlier calls' prompts and completions, reused by later
    prompts that extend them; see PrefixCache) only save work, and `paged` (a paged KV cache of `kv_block`-slot
    blocks; "auto": buckets.paged_by_default) only saves memory; turning them off gives the same completions (tests
    compare both ways), and so does `prefill_chunk` (prompts prefilled in chunks of at most this many tokens:
    the bound on prefill memory).
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
                 rules=None, prefix_cache_tokens: int = 8192, prefix_block: int = buckets.PREFIX_BLOCK,
                 continuous: bool = True, paged: bool | str = "auto", kv_block: int = 16, compaction_buckets: int = 16,
                 compaction_patience: int = 64, prefill_chunk: int = PREFILL_CHUNK, kv_budget_bytes: int = 0,
                 max_batched_tokens: int = 0, check_blocks: bool = False, kv_dtype=None):
        from marl_jax.policy.lora import PolicySpec

        self.cfg = cfg
        self.spec = spec or PolicySpec()
        self.dtype = dtype
        # Keys and values are stored in kv_dtype (default: the compute dtype) and read back in the compute dtype:
        # bfloat16 halves the KV cache under float32 compute, and the TPU paged-attention kernel needs it.
        self.kv_dtype = jnp.dtype(kv_dtype or dtype)
        self.max_batch, self.pad_id, self.mesh, self.rules = max_batch, pad_id, mesh, rules
        self.continuous, self.share_prefix = continuous, share_prefix
        if kv_block < 1:
            raise ValueError(f"kv_block must be >= 1, got {kv_block}")
        if kv_budget_bytes < 0 or max_batched_tokens < 0:
            raise ValueError(f"kv_budget_bytes and max_batched_tokens must be >= 0 (0 = off), got "
                             f"{kv_budget_bytes}, {max_batched_tokens}")
        if paged not in (True, False, "auto"):
            raise ValueError(f"paged must be True, False or 'auto', got {paged!r}")
        # A KV budget fixes the paged pool's size: rows are admitted while their blocks fit and preempted
        # (recomputed later) when it runs dry, so the budget needs the paged cache.
        self.kv_budget_bytes = int(kv_budget_bytes)
        self.paged = (buckets.paged_by_default(jax.default_backend()) if paged == "auto" else paged) or \
            self.kv_budget_bytes > 0
        self.kv_block = kv_block
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        # A refill's prefill shares max_batched_tokens with the running rows: no chunk is longer.
        chunk = min(prefill_chunk, max_batched_tokens) if max_batched_tokens else prefill_chunk
        if compaction_buckets < 1:
            raise ValueError(f"compaction_buckets must be >= 1, got {compaction_buckets}")
        if compaction_patience < 1:
            raise ValueError(f"compaction_patience must be >= 1, got {compaction_patience}")
        self.data_size = sharding.row_count(mesh)  # rows are split over data x fsdp
        self.scheduling = SchedulerConfig(max_batch=max_batch, min_batch=max(min_batch, self.data_size),
                                          shards=self.data_size, compaction=compaction, per_octave=compaction_buckets,
                                          patience=compaction_patience, max_batched_tokens=int(max_batched_tokens),
                                          check_blocks=check_blocks)
        self.programs = Programs(ProgramConfig(cfg, self.spec, dtype, self.kv_dtype, pad_id, chunk, mesh, rules))
        self.stats: dict[str, Any] = {}
        self.prefix_cache = (PrefixCache(cfg, -(-prefix_cache_tokens // prefix_block), prefix_block, self.kv_dtype,
                                         mesh, rules) if prefix_cache_tokens > 0 else None)
        # Under a CallShape, the shared prefix each (slot, shape) was first prefilled with: later calls
        # share it or none, so their prefill is one of two programs, not one per prefix length.
        self.prefix_lens: dict[tuple, int] = {}
        self._warm_prefixes: set[tuple] = set()  # (slot, shape, prefix) whose refill prefills compiled

    def put(self, value) -> jax.Array:
        """A host value as a program's argument: on a mesh replicated over it (committed, so programs are compiled
        for it and take it as it is, in the warm-up and in the calls alike)."""
        if self.mesh is None:
            return to_device(value)
        return jax.device_put(value, NamedSharding(self.mesh, PartitionSpec()))

    @property
    def prefill_chunk(self) -> int:
        return self.programs.pc.prefill_chunk

    def block_bytes(self) -> int:
        """Bytes of one KV block (keys and values, every layer) on one device."""
        c = self.cfg
        model = 1 if self.mesh is None else self.mesh.shape.get("model", 1)
        return buckets.block_bytes(c.num_layers, c.num_kv_heads, c.head_dim, self.kv_block, self.kv_dtype.itemsize, model)

    def kernel_decode(self) -> bool:
        """Paged decode reads the pool in place through the paged-attention kernel (so no attention window is
        needed: the kernel reads each row's own length)."""
        return self.paged and attn.choose(self.cfg.attention, 1, 1, dtype=self.kv_dtype, pool=True) == "paged"

    def generate(self, params, prompts: Sequence[Sequence[int]], key: jax.Array, sp: SamplingParams, *,
                 max_new_tokens: Sequence[int] | None = None, trainable=None, slot: int = 0,
                 shape: CallShape | None = None) -> SampleOutput:
        """Sample one completion per prompt. `max_new_tokens` optionally limits rows individually. `shape`: the
        rows, distinct prompts and prompt length the call's programs are sized for (padding up to them), so
        that calls of a run share the programs Sampler.warmup compiled; None: sized by this call's prompts."""
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
        self.stats = {"prefill_rows": 0, "prefill_tokens": 0, "prompt_tokens": 0, "cached_tokens": 0, "prefill_s": 0.0,
                      "decode_s": 0.0, "decode_steps": 0, "row_steps": 0, "compactions": 0, "fine_compactions": 0,
                      "refills": 0, "stored_tokens": 0, "peak_kv_bytes": 0, "peak_prefill_distinct": 0,
                      "peak_prefill_rows": 0}
        if self.paged:
            self.stats.update(peak_kv_live_bytes=0, pool_grows=0, preemptions=0, recomputed_tokens=0,
                              recomputed_prompt_tokens=0, resumed_rows=0, resume_prefills=0)
        if self.prefix_cache is not None:
            self.prefix_cache.bind(params, trainable)
        # Longest prompts first, so each chunk's prompt bucket is tight.
        order = np.argsort([-len(p) for p in prompts], kind="stable")
        # Continuous batching runs every row through one batch of at most max_batch rows, refilled as rows
        # finish; otherwise each chunk of max_batch rows runs to its end before the next starts.
        chunk = n if self.continuous else self.max_batch
        for start in range(0, n, chunk):
            idx = order[start:start + chunk]
            self._generate_chunk(params, [prompts[i] for i in idx], idx, key, sp, limits[idx], trainable, slot, out,
                                 prompts, shape)
        self.stats["useful_row_steps"] = int(np.maximum(out.lengths - 1, 0).sum())
        return out

    def layout(self, prompts, slot_id: int, shape: CallShape | None = None) -> PromptLayout:
        """The prompt layout of a call: its distinct prompts' cached blocks (the cached region C) or the prefix
        they share, and the rest S; under a CallShape the region P is at least its prompt length, bucketed, and
        the shared prefix the one its first call had (or none)."""
        uniq = list(dict.fromkeys(tuple(p) for p in prompts))
        # Prompts extending an earlier call's sequences load those keys and values from the prefix cache.
        pc = self.prefix_cache
        hits = {p: pc.lookup(slot_id, p) for p in uniq} if pc is not None else {}
        C, prefix = 0, ()
        # A stage's first call sets its shared prefix (below), so it loads no hits: else a first call finding
        # hits (a validation call's, under the same parameters) would leave that prefill to a later step.
        first_call = shape is not None and self.share_prefix and (slot_id, shape) not in self.prefix_lens
        if any(hits.values()) and not first_call:
            if shape is None:
                C = length_bucket(max(len(b) for b in hits.values()) * pc.block)
            else:  # one of a fixed set of regions (the warm-up compiles them), hits cut to it
                C = buckets.hit_region(uniq, [len(hits[p]) * pc.block for p in uniq], self.prompt_region(shape),
                                       pc.block)
                hits = {p: b[:C // pc.block] for p, b in hits.items()}
        cached = {p: len(b) * pc.block for p, b in hits.items()} if C else {}
        # Otherwise, a prefix all distinct prompts share (a role's system prompt and instructions) is
        # prefilled once per prefill.
        if not C:
            hits, cached = {}, {}
            if self.share_prefix:
                C = buckets.shared_prefix_len(uniq)
                if shape is not None:
                    C = self._fixed_prefix((slot_id, shape), C)
                cached, prefix = {p: C for p in uniq}, uniq[0][:C]
        if pc is not None:  # the blocks this call loads stay while it runs
            pc.pinned = {b for bs in hits.values() for b in bs}
        # The prompt region P as a whole is a length bucket (not C + a bucket): P sets the shapes of the
        # decode programs (the cache window P + Tn), so a step whose prompts share a longer prefix reuses them.
        P = length_bucket(C + max(len(p) - cached.get(p, 0) for p in uniq))
        if shape is not None:
            if P > self.prompt_region(shape):
                _over_shape(shape, max(len(p) for p in uniq), P)
            P = max(P, self.prompt_region(shape))
        return PromptLayout(hits, cached, C, P - C, tuple(prefix))

    @staticmethod
    def prompt_region(shape: CallShape) -> int:
        """The prompt slots P of a call sized by `shape`."""
        return length_bucket(max(shape.prompt, 1))

    def _fixed_prefix(self, key: tuple, C: int) -> int:
        """The shared prefix a call under a CallShape prefills: the first call's (remembered per slot and shape,
        that is per stage) when these prompts share it, else none."""
        first = self.prefix_lens.setdefault(key, C)
        return first if C >= first else 0

    def _generate_chunk(self, params, prompts, row_ids, key, sp, limits, trainable, slot, out, all_prompts, shape):
        Tn = length_bucket(sp.max_new_tokens)
        lay = self.layout(prompts, int(slot), shape)
        sc = self.scheduling
        B = sc.first_batch(max(len(prompts), shape.rows if shape else 0))
        self._warm_refills(params, trainable, slot, sp, shape, lay, B, key)
        pool = None
        if self.paged:
            D, blk = self.data_size, self.kv_block
            T = buckets.blocks_for(lay.P + Tn, blk) * blk
            full = buckets.full_pool_blocks(B // D, lay.P, Tn, blk)
            if self.kv_budget_bytes or shape is not None:  # one size: its programs compile once
                blocks = self.pool_blocks(B, lay.P, Tn, shape)
            else:  # per shard, a first pool for its first rows' prompts; it grows as rows need more
                first = prompts[:B]
                distinct = max(len({tuple(p) for p in first[d * (B // D):(d + 1) * (B // D)]}) for d in range(D))
                blocks = buckets.first_pool_blocks(B // D, distinct, lay.P, Tn, blk)
            pool = BlockPool(D, blocks, blk, B // D, T // blk, full, fixed=bool(self.kv_budget_bytes))
            if self.kv_budget_bytes:
                self._refuse_oversized(prompts, limits, pool)
        keys = [tuple(p) for p in prompts]
        sched = Scheduler(sc, [(k, len(k)) for k in keys], pool, [lay.cached.get(k, 0) for k in keys], batch=B)
        rows = DeviceRows(self, params, trainable, int(slot), lay, sp, Tn, prompts, row_ids, limits, key, out, pool,
                          B, all_prompts, shape.distinct if shape else 0)
        t0 = time.perf_counter()
        sched.run(rows)
        for k, v in sched.stats.items():
            if k in self.stats:
                self.stats[k] += v
        self.stats["decode_s"] += time.perf_counter() - t0 - rows.admit_s

    def warmup(self, params, sp: SamplingParams, shape: CallShape, *, trainable=None, slot: int = 0,
               key: jax.Array | None = None, workers: int = 1) -> int:
        """Compile, without running, the programs a call sized by `shape` runs: its prefill (with no shared
        prefix; the first call compiles the one with its prefix), the decode loop at every batch size compaction
        can reach (buckets.compaction_sizes) and every attention window, the compactions between those sizes and
        the prefix-cache store from each, and the prefills loading prefix-cache hits (buckets.cached_regions);
        paged, the empty pool (one size per CallShape) and the insertion of the first rows into it. On a mesh
        each program is compiled for the shardings the one before it gives the state (so one after another); on
        several processes the loop's host reads (all-gathers) run too. Returns the programs compiled. Under a KV
        budget the pool is the budget's; rows it preempts come back through prefills of their tokens, which
        compile when met. A shape over rollout.max_batch refills: its refill prefills (without a shared prefix
        and at each cached region; the first call compiles those with the prefix it sets) and the insertion of a
        refill chunk. Calls beyond the shape (longer prompts) compile what they need when met (and say so)."""
        import concurrent.futures

        key = jax.random.PRNGKey(0) if key is None else key
        sc, Tn, P, D = self.scheduling, length_bucket(sp.max_new_tokens), self.prompt_region(shape), self.data_size
        B = sc.first_batch(shape.rows)
        Bu = buckets.batch_bucket(min(shape.distinct, B), 1, D)
        i32 = lambda *shape_: self.put(np.zeros(shape_, np.int32))
        slot_ = jnp.int32(slot)
        lowered, compiled = [], []

        def state_after(fn, *args):
            """Lower `fn` (on a mesh, compile it) and return what it returns, abstract: on a mesh with the shardings
            its compiled program gives it."""
            low = fn.lower(*args)
            if self.mesh is None:
                lowered.append(low)
                return low.out_info
            compiled.append(low.compile())
            return sharding.compiled_outputs(compiled[-1])

        cache_len = P if self.paged else P + Tn  # paged: the prompt slots, then written into the pool
        prefill = self.programs.prefill(sp, cache_len, Tn)
        args = (params, trainable, slot_, i32(0), i32(Bu, P), self.put(np.ones((Bu, P), bool)), i32(Bu), i32(B),
                i32(B), i32(B), key, None, None)
        state = state_after(prefill, *args)
        windows = buckets.call_windows(P, Tn, self.kv_block if self.paged else 0, self.kernel_decode())
        if self.paged:  # the first rows' prefill goes into an empty pool of the shape's one size
            blk = self.kv_block
            T = buckets.blocks_for(P + Tn, blk) * blk
            N = self.pool_blocks(B, P, Tn, shape)
            pool_state = state_after(self.programs.empty_paged(B, N, blk, T, D, Tn))
            state = state_after(self.programs.paged_insert(), pool_state, state, i32(B), i32(B, T // blk),
                                i32(B, T // blk), i32(B), i32(D, N), i32(D))
        gather = self.programs.gather()
        sizes = buckets.compaction_sizes(B, sc.min_batch, sc.shards, sc.per_octave) if sc.compaction else [B]
        moves = buckets.compaction_moves(B, sc.min_batch, sc.shards, sc.per_octave) if sc.compaction else []
        states = {B: state}
        for b, c in sorted(moves, key=lambda m: -m[0]):  # each size's state as the compaction onto it leaves it
            states[c] = state_after(gather, states[b], i32(c), self.put(np.ones(c, bool)))
        pc = self.prefix_cache
        if pc is not None:  # prefills loading prefix-cache hits, at each cached region they may take
            pc.ensure()
            for C in buckets.cached_regions(P, pc.block):
                hit = (params, trainable, slot_, i32(0), i32(Bu, P - C), self.put(np.ones((Bu, P - C), bool)),
                       i32(Bu), i32(B), i32(B), i32(B), key, (pc.k, pc.v, i32(Bu, C)), None)
                state_after(prefill, *hit)
        if shape.rows > B:  # refills, in chunks of R rows: their prefills, at every region, and the insertion
            R = buckets.refill_rows(B, D)
            regions = (0,) + (buckets.cached_regions(P, pc.block) if pc is not None else ())
            for fn, args in self._refill_prefills(params, trainable, slot, sp, P, Tn, B, key, 0, regions):
                new = state_after(fn, *args)
            if self.paged:
                state_after(self.programs.paged_insert(), states[B], new, i32(R), i32(R, T // blk), i32(R, T // blk),
                            i32(R), i32(D, N), i32(D))
            else:
                state_after(self.programs.insert(), states[B], new, i32(R))
        for b in sizes:
            for w in windows:
                state_after(self.programs.decode(sp, P, w), params, trainable, slot_, states[b], key, jnp.int32(0),
                            jnp.int32(0))
            if pc is not None:
                m = buckets.STORE_CHUNK
                state_after(self.programs.store(), pc.k, pc.v, states[b].cache, i32(m), i32(m), i32(m))
        # One device: traced above, one at a time (flax builds its transform classes while tracing, and that is
        # not thread-safe), and compiled here in threads (XLA compiles outside the GIL).
        with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as ex:
            list(ex.map(lambda low: low.compile(), lowered))
        return len(lowered) + len(compiled) + self._warm_host_reads(states.values())

    def _warm_host_reads(self, states) -> int:
        """Several processes: the host reads of a state split over them (to_host) are all-gathers, a program
        per shape; runs those the call's loop makes at each batch size (on zeros). Returns the programs."""
        if self.mesh is None or jax.process_count() == 1:
            return 0
        seen = {}
        for st in states:
            reads = [st.row_id, st.active, st.step, st.pos, st.out_tokens, st.out_logp]
            if self.paged:
                reads += [st.cache.table, st.cache.top]
            for x in reads:
                seen.setdefault((x.shape, x.dtype, x.sharding), x)
        for x in seen.values():
            to_host(jax.make_array_from_callback(x.shape, x.sharding, lambda idx, x=x: np.zeros(x.shape, x.dtype)[idx]))
        return len(seen)

    def pool_blocks(self, B: int, P: int, Tn: int, shape: CallShape | None) -> int:
        """A row shard's paged pool of one size for a batch of B rows under prompt region P: the KV budget's blocks
        (fixed), else under a CallShape the shape's (every row at its limit, never grown)."""
        D, blk = self.data_size, self.kv_block
        full = buckets.full_pool_blocks(B // D, P, Tn, blk)
        if self.kv_budget_bytes:
            return buckets.budget_pool_blocks(self.kv_budget_bytes, self.block_bytes(), full)
        return buckets.shape_pool_blocks(B // D, shape.distinct, P, Tn, blk)

    def _refill_prefills(self, params, trainable, slot, sp, P, Tn, B, key, prefix: int, regions=(0,)):
        """(program, arguments) of each prefill a refill of a batch of B rows under prompt region P can run
        (DeviceRows.admit: chunks of buckets.refill_rows, distinct prompts at buckets.refill_distinct): with a
        shared prefix of `prefix` tokens and no hits when the region is 0, else the region's prefix-cache hits."""
        D, pc = self.data_size, self.prefix_cache
        R = buckets.refill_rows(B, D)
        i32 = lambda *shape_: self.put(np.zeros(shape_, np.int32))
        prefill = self.programs.prefill(sp, P if self.paged else P + Tn, Tn)
        for C in regions:
            for bu in buckets.refill_distinct_sizes(R, D):
                S = P - (C or prefix)
                hit = (pc.k, pc.v, i32(bu, C)) if C else None
                yield prefill, (params, trainable, jnp.int32(slot), i32(0 if C else prefix), i32(bu, S),
                                self.put(np.ones((bu, S), bool)), i32(bu), i32(R), i32(R), i32(R), key, hit, None)

    def _warm_refills(self, params, trainable, slot, sp, shape: CallShape, lay: PromptLayout, B: int, key):
        """A call whose rows refill and whose prompts share the prefix its stage's first call set: compile that
        prefix's refill prefills now (in threads), so later calls meet only compiled programs. Once per stage."""
        import concurrent.futures

        if shape is None or shape.rows <= B or not lay.prefix:
            return
        done = (slot, shape, len(lay.prefix))
        if done in self._warm_prefixes:
            return
        self._warm_prefixes.add(done)
        P, Tn = self.prompt_region(shape), length_bucket(sp.max_new_tokens)
        lowered = [fn.lower(*args) for fn, args in
                   self._refill_prefills(params, trainable, slot, sp, P, Tn, B, key, len(lay.prefix))]
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda low: low.compile(), lowered))

    def _refuse_oversized(self, prompts, limits, pool: BlockPool):
        """A row whose prompt and completion need more blocks than the budget's pool holds would never run:
        refuse the call before sampling, naming the knobs."""
        worst = max(len(pool.spans(len(p), int(n))) for p, n in zip(prompts, limits))
        usable = pool.usable()
        if worst > usable:
            per = self.block_bytes()
            raise ValueError(
                f"one row needs {worst} KV blocks ({worst * per / 2**30:.3f} GiB: its prompt and up to "
                f"{int(max(limits))} new tokens) but the KV budget holds {usable} "
                f"({self.kv_budget_bytes / 2**30:.3f} GiB per device): raise --config.rollout.kv_budget_gb to at "
                f"least {(worst + 2) * per / 2**30 * 1.02:.3f}, or lower --config.rollout.max_new_tokens or the "
                "prompt's length")


class DeviceRows:
    """One call's batch on the device: the DecodeState, and the moves the scheduler asks for (the Rows protocol
    of marl_jax.generate.scheduler). Rows are the call's `prompts` by index; on the device each carries its
    global row id (`row_ids`), which keys its randomness."""

    def __init__(self, sampler: Sampler, params, trainable, slot: int, layout: PromptLayout, sp: SamplingParams,
                 Tn: int, prompts, row_ids, limits, key, out: SampleOutput, pool: BlockPool | None, B: int,
                 all_prompts, distinct: int = 0):
        self.s, self.params, self.trainable, self.slot = sampler, params, trainable, slot
        self.distinct = distinct  # the first prefill's distinct prompts are padded to this many (CallShape)
        self.lay, self.sp, self.Tn, self.prompts, self.row_ids, self.limits = layout, sp, Tn, prompts, row_ids, limits
        self.key, self.out, self.pool, self.B, self.all_prompts = key, out, pool, B, all_prompts
        self.programs = sampler.programs
        self.stats = sampler.stats
        self.local = {int(r): i for i, r in enumerate(row_ids)}
        self.gens: dict[int, tuple] = {}  # row -> (tokens, log-probs) of a preempted row, until it resumes
        self.placed: dict[int, tuple[int, int]] = {}  # global row -> (cached tokens, P): where its prompt sits
        self.admit_s = 0.0
        self._view = None
        self.state = self._empty_paged() if pool is not None else None

    # ---- the host's view ----

    def view(self) -> View:
        if self._view is None:
            if self.state is None:  # dense, before the first rows: fillers
                z = np.zeros(self.B, np.int64)
                self._view = View(np.zeros(self.B, bool), z + 1, z, z - 1)
            else:
                st = self.state
                rid = to_host(st.row_id)
                row = np.array([self.local.get(int(r), -1) for r in rid])
                table = to_host(st.cache.table) if self.pool is not None else None
                self._view = View(to_host(st.active), to_host(st.step), to_host(st.pos), row, table)
        return self._view

    def _set(self, state: DecodeState):
        self.state, self._view = state, None

    def _like(self, old: jax.Array, value: np.ndarray) -> jax.Array:
        """A host value replacing a leaf of the state: on a mesh with that leaf's sharding, so the next program
        meets the shardings its warm-up compiled for."""
        return to_device(value) if self.s.mesh is None else jax.device_put(value, old.sharding)

    # ---- decode ----

    def _window(self, v: View) -> int:
        P, Tn = self.lay.P, self.Tn
        if self.pool is not None:
            T = self.pool.width * self.pool.block
            if self.s.kernel_decode():  # the kernel reads each row's length: one program, no windows
                return T
        steps = np.where(v.active, v.step, 1)
        window = next(w for w in buckets.decode_windows(P, Tn) if w >= P + steps.max())
        if self.pool is not None:
            window = buckets.pool_window(window, self.pool.block, T)
        return window

    def decode(self, exit_at: int, max_steps: int) -> int:
        v = self.view()
        window = self._window(v)
        state = self.state
        if self.pool is not None:
            pool = self.pool
            newN = pool.grow(BlockPool.wanted(v.pos, v.active, v.table, pool.shards, pool.block))
            if newN is not None:
                c = state.cache
                k, vv = self.programs.grow(newN)(c.k, c.v)
                state = state._replace(cache=c._replace(k=k, v=vv))
                self.stats["pool_grows"] += 1
            free, top = pool.device_free()
            c = state.cache
            state = state._replace(cache=c._replace(free=self._like(c.free, free), top=self._like(c.top, top)))
        fn = self.programs.decode(self.sp, self.lay.P, window)
        state, it = fn(self.params, self.trainable, jnp.int32(self.slot), state, self.key, jnp.int32(exit_at),
                       jnp.int32(max_steps))
        self._set(state)
        if self.pool is not None:
            self.pool.popped(to_host(state.cache.top))
        self._count_kv()
        return int(it)

    def _count_kv(self):
        """Peak KV bytes: the decode cache as allocated (the pool, when paged) and, paged, the blocks in use."""
        c = self.state.cache
        self.stats["peak_kv_bytes"] = max(self.stats["peak_kv_bytes"], c.k.nbytes + c.v.nbytes)
        if self.pool is not None:
            p = self.pool
            used = int((p.blocks - 1 - p.free_count()).sum())
            self.stats["peak_kv_live_bytes"] = max(self.stats["peak_kv_live_bytes"],
                                                   (c.k.nbytes + c.v.nbytes) * used // (p.shards * p.blocks))

    # ---- rows in ----

    def _empty_paged(self) -> DecodeState:
        p = self.pool
        return self.programs.empty_paged(self.B, p.blocks, p.block, p.width * p.block, p.shards, self.Tn)()

    def admit(self, rows: Sequence[int], slots: np.ndarray):
        t0 = time.perf_counter()
        rows, slots = list(rows), np.asarray(slots)
        # Under a CallShape, refills run in chunks of one size (buckets.refill_rows): programs the warm-up compiled.
        step = buckets.refill_rows(self.B, self.s.data_size) if self.distinct and self.placed else len(rows)
        for i in range(0, len(rows), step):
            self._admit(rows[i:i + step], slots[i:i + step])
        self.admit_s += time.perf_counter() - t0

    def refill_batch(self, n: int) -> int:
        """The batch a refill of n rows is prefilled at: the CallShape's chunk, else n's batch bucket."""
        D = self.s.data_size
        return buckets.refill_rows(self.B, D) if self.distinct else buckets.batch_bucket(n, 1, D)

    def _admit(self, rows: list[int], slots: np.ndarray):
        prompts = [self.prompts[i] for i in rows]
        gens = [self.gens.pop(i, None) for i in rows]
        ids, limits = self.row_ids[rows], self.limits[rows]
        if self.pool is not None:
            self._set(self._admit_paged(prompts, ids, limits, slots, gens))
        elif self.state is None:  # the first rows: prefilled straight into the batch (slots 0..n-1)
            self._set(self.prefill(prompts, ids, limits, self.B))
        else:
            Bg = self.refill_batch(len(rows))
            new = self.prefill(prompts, ids, limits, Bg)
            dest = np.full(Bg, len(self.view().active), np.int32)
            dest[:len(rows)] = slots
            self._set(self.programs.insert()(self.state, new, self.s.put(dest)))

    def prefill(self, prompts, row_ids, limits, B, cache_len=None, gens=None) -> DecodeState:
        """Prefill `prompts` (rows row_ids) into a fresh state of B rows laid out by the call's layout, with a
        dense cache of cache_len slots (default: the prompt and every new token; the paged path takes the prompt
        only). gens (or None): per row, None or the (tokens, log-probs) it generated before it was preempted;
        those rows' tokens but the last are prefilled after the prompt (the cache then needs P + G slots)."""
        s, lay, Tn = self.s, self.lay, self.Tn
        n = len(prompts)
        uniq: dict[tuple, int] = {}
        expand = np.zeros(B, np.int32)
        for i, p in enumerate(prompts):  # identical prompts (the G episodes of a task) are prefilled once
            expand[i] = uniq.setdefault(tuple(p), len(uniq))
        # The distinct prompts at their own bucketed count (not min_batch: one long prompt is one row); the
        # first fill at the CallShape's count at least.
        first = not self.placed
        if self.distinct and not first:  # a CallShape's refill: one of a few sizes (the warm-up compiles them)
            Bu = buckets.refill_distinct(len(uniq), B, s.data_size)
        else:
            Bu = buckets.batch_bucket(max(len(uniq), min(self.distinct, B) if first else 0), 1, s.data_size)
        C, S, cached, hits, pc = lay.C, lay.S, lay.cached, lay.hits, s.prefix_cache
        tokens = np.full((Bu, S), s.pad_id, np.int32)
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
        kv_pool = (pc.k, pc.v, self.s.put(src)) if hits else None
        resume = None
        if gens is not None and any(x is not None for x in gens):
            g = np.zeros(B, np.int32)
            prev_t = np.full((B, Tn), s.pad_id, np.int32)
            prev_l = np.zeros((B, Tn), np.float32)
            for i, x in enumerate(gens):
                if x is not None:
                    g[i] = len(x[0])
                    prev_t[i, :g[i]], prev_l[i, :g[i]] = x
            G = buckets.resume_slots(int(g.max()))
            resume = (self.s.put(prev_t[:, :G]), self.s.put(prev_t), self.s.put(prev_l), self.s.put(g))
        rid = np.full(B, -1, np.int32)
        rid[:n] = row_ids
        max_len = np.zeros(B, np.int32)
        max_len[:n] = limits
        t0 = time.perf_counter()
        state = self.programs.prefill(self.sp, cache_len or lay.P + Tn, Tn)(
            self.params, self.trainable, jnp.int32(self.slot), self.s.put(np.asarray(lay.prefix, np.int32)),
            self.s.put(tokens), self.s.put(valid), self.s.put(offset), self.s.put(expand), self.s.put(max_len),
            self.s.put(rid), self.key, kv_pool, resume)
        jax.block_until_ready(state.token)
        st = self.stats
        st["prefill_s"] += time.perf_counter() - t0
        st["prefill_rows"] += len(uniq)
        # The dense caches this prefill built (distinct prompts, then every row): what marl_jax.plan counts.
        st["peak_prefill_distinct"] = max(st["peak_prefill_distinct"], Bu)
        st["peak_prefill_rows"] = max(st["peak_prefill_rows"], B)
        st["prefill_tokens"] += len(lay.prefix) + sum(len(p) - cached.get(p, 0) for p in uniq)
        if resume is not None:  # preempted rows computed again: their prompts (once per distinct one) and tokens
            gen_tokens = sum(len(x[0]) - 1 for x in gens if x is not None)
            again = sum(len(p) - cached.get(p, 0) for p in {tuple(p) for p, x in zip(prompts, gens) if x is not None})
            st["prefill_tokens"] += gen_tokens
            st["recomputed_tokens"] += gen_tokens + again
            st["recomputed_prompt_tokens"] += again
            st["resumed_rows"] += sum(x is not None for x in gens)
            st["resume_prefills"] += 1
        st["prompt_tokens"] += sum(len(p) for p in uniq)
        if hits:
            st["cached_tokens"] += sum(cached.get(p, 0) for p in uniq)
        # Where each row's prompt tokens sit in a dense cache: its first `cached` tokens at slots [0, cached),
        # the rest ending at slot P (completion token t goes to slot P + t).
        for r, p in zip(row_ids, prompts):
            self.placed[int(r)] = (cached.get(tuple(p), 0), lay.P)
        return state

    def _admit_paged(self, prompts, row_ids, limits, dest, gens) -> DecodeState:
        """Prefill `prompts` (a dense cache of the prompt slots only, and of the tokens preempted rows had
        generated), give each row blocks of its shard for the slots it fills, and write the rows into batch rows
        `dest` of the running state."""
        pool, P, n = self.pool, self.lay.P, len(prompts)
        glen = [0 if x is None else len(x[0]) for x in gens]
        G = buckets.resume_slots(max(glen)) if any(glen) else 0
        B = self.state.active.shape[0]
        # The first rows under a CallShape fill the whole batch (the padded rows are dropped), as the dense
        # path's first prefill does: one program whatever the call's rows.
        Bg = B if self.distinct and not self.placed else self.refill_batch(n)
        new = self.prefill(prompts, row_ids, limits, Bg, cache_len=P + G, gens=gens + [None] * (Bg - n))
        shard = np.asarray(dest) // (B // pool.shards)
        keys = [(tuple(p), len(p)) for p in prompts]
        spans = [pool.spans(len(p), g) for p, g in zip(prompts, glen)]
        newN = pool.grow(pool.admission_need(shard, keys, spans)[-1])
        state = self.state
        if newN is not None:
            c = state.cache
            k, v = self.programs.grow(newN)(c.k, c.v)
            state = state._replace(cache=c._replace(k=k, v=v, free=jnp.zeros((pool.shards, newN), jnp.int32)))
            self.stats["pool_grows"] += 1
        table = np.zeros((Bg, pool.width), np.int32)
        write = np.zeros((Bg, pool.width), np.int32)
        table[:n], write[:n] = pool.assign(shard, keys, spans)
        to = np.full(Bg, B, np.int32)
        to[:n] = dest
        sh = np.zeros(Bg, np.int32)
        sh[:n] = shard
        free, top = pool.device_free()
        return self.programs.paged_insert()(state, new, self.s.put(to), self.s.put(table), self.s.put(write),
                                            self.s.put(sh), self.s.put(free), self.s.put(top))

    # ---- rows out ----

    def harvest(self, final: bool):
        """Copy the results of every real row that finished (every real row when `final`) to the host output,
        and their keys and values to the prefix cache; a harvested row's place can then be reused (paged:
        its blocks go back to the pool)."""
        state, out = self.state, self.out
        rid = to_host(state.row_id)
        done = (rid >= 0) & (np.ones_like(rid, bool) if final else ~to_host(state.active))
        toks = to_host(state.out_tokens)[done]
        lps = to_host(state.out_logp)[done]
        steps = to_host(state.step)[done]
        rows = rid[done]
        Tn_out = out.tokens.shape[1]
        stops = self.sp.stop_ids
        # A row's length: up to and including its stop token, capped by its limit and its step count.
        hit_stop = np.isin(toks, np.asarray(stops)) if stops else np.zeros(toks.shape, bool)
        for j, r in enumerate(rows):
            hit = np.flatnonzero(hit_stop[j, :steps[j]])
            length = hit[0] + 1 if len(hit) else int(steps[j])
            length = min(length, int(self.limits[self.local[int(r)]]), Tn_out)
            out.tokens[r, :length] = toks[j, :length]
            out.logprobs[r, :length] = lps[j, :length]
            out.tokens[r, length:] = self.s.pad_id
            out.logprobs[r, length:] = 0.0
            out.lengths[r] = length
            out.finished[r] = bool(len(hit)) and hit[0] < length
        if self.s.prefix_cache is not None:
            self._store([(int(b), int(r)) for b, r in zip(np.flatnonzero(done), rows)])
        if self.pool is not None and not final:
            self._release(done)

    def _release(self, done: np.ndarray):
        """Paged: batch rows `done` give their blocks back to their shard and become fillers (row id -1)."""
        state = self.state
        table = to_host(state.cache.table).copy()
        per = len(table) // self.pool.shards
        for r in np.flatnonzero(done):
            self.pool.release(int(r) // per, table[r][table[r] > 0])
        table[done] = 0
        rid = np.where(done, -1, to_host(state.row_id)).astype(np.int32)
        self._set(state._replace(row_id=self._like(state.row_id, rid),
                                 active=self._like(state.active, to_host(state.active) & ~done),
                                 cache=state.cache._replace(table=self._like(state.cache.table, table))))

    def preempt(self, slot: int) -> int:
        st = self.state
        r = int(to_host(st.row_id)[slot])
        g = int(to_host(st.step)[slot])
        self.gens[self.local[r]] = (to_host(st.out_tokens)[slot, :g].copy(), to_host(st.out_logp)[slot, :g].copy())
        done = np.zeros(st.active.shape[0], bool)
        done[slot] = True
        self._release(done)
        return g

    def compact(self, idx: np.ndarray, keep: np.ndarray):
        self._set(self.programs.gather()(self.state, self.s.put(idx), self.s.put(keep)))

    def _store(self, rows: list[tuple[int, int]]):
        """Copy the full blocks of finished rows' sequences (prompt and completion but its last token, which
        was never fed back) into the prefix cache: one gather-scatter program per bucket of token count."""
        pc, out = self.s.prefix_cache, self.out
        src_row, src_slot, dst = [], [], []
        taken: set = set()
        for b, r in rows:
            prompt = list(self.all_prompts[r])
            n = int(out.lengths[r])
            seq = prompt + out.tokens[r, :n - 1].tolist()
            cached, P = self.placed[r]
            for start, block in pc.reserve(self.slot, seq, taken):
                j = np.arange(start, start + pc.block)
                if self.pool is not None:  # compacted: token j in slot j
                    slots = j
                else:
                    slots = np.where(j < cached, j, np.where(j < len(prompt), P - len(prompt) + j, P + j - len(prompt)))
                src_row += [b] * pc.block
                src_slot += slots.tolist()
                dst += (block * pc.block + np.arange(pc.block)).tolist()
        if not dst:
            return
        pc.ensure()
        m = buckets.STORE_CHUNK  # one program whatever the count: chunks of m slots, the last padded
        for a in range(0, len(dst), m):
            pad = m - len(dst[a:a + m])
            idx = [self.s.put(np.asarray(x[a:a + m] + [f] * pad, np.int32)) for x, f in
                   ((src_row, 0), (src_slot, 0), (dst, pc.num_blocks * pc.block))]
            pc.k, pc.v = self.programs.store()(pc.k, pc.v, self.state.cache, *idx)
        self.stats["stored_tokens"] += len(dst)
