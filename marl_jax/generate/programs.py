"""The sampler's jitted programs (the memory they act on is a DecodeState; when to run them is decided by
marl_jax.generate.scheduler).

Prefill: the distinct prompts (a task's episodes share one) run at their own bucketed count, in chunks of
`prefill_chunk` tokens against the cache (marl_jax.generate.prefill), so its memory grows linearly with the
prompt; each row then gets a copy of its prompt's cache. Rows preempted under a KV budget come back through
the same program: their prompt is prefilled once per distinct prompt, then each row's tokens generated so far,
and the row continues exactly where it stopped. Decode: a `lax.while_loop` over the batch until the host has
something to do (refill, compaction, a longer attention window, a paged pool short of blocks).

Parameters are arguments of the programs (never closed over), so updating them does not recompile. Shapes are
bucketed (marl_jax.generate.buckets), so a run compiles a handful of programs whatever its inputs.

Randomness is keyed per (row, token index) (marl_jax.generate.sampling), so a row's sample does not depend on
which other rows share its batch, on compaction or on preemption; the same key gives the same completions.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from marl_jax.generate.prefill import prefill_chunks
from marl_jax.generate.sampling import row_keys, sample_tokens
from marl_jax.generate.types import DecodeState, SamplingParams
from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import PREFIX_AXES, KVCache, ModelConfig, PagedCache


@dataclasses.dataclass(frozen=True)
class ProgramConfig:
    """What the programs are built for (static across a run)."""
    cfg: ModelConfig
    spec: Any  # marl_jax.policy.lora.PolicySpec
    dtype: Any
    kv_dtype: Any
    pad_id: int
    prefill_chunk: int
    mesh: Any = None
    rules: Any = None


class Programs:
    """The jitted programs of a Sampler, built once per static signature and kept in `fns`."""

    def __init__(self, pc: ProgramConfig):
        self.pc = pc
        self.fns: dict[Any, Any] = {}

    def _memo(self, key, build):
        if key not in self.fns:
            self.fns[key] = build()
        return self.fns[key]

    def select(self, params, trainable, slot):
        if trainable is None:
            return params, None
        from marl_jax.policy.lora import slot_params
        return slot_params(self.pc.spec, params, trainable, slot)

    def constrain(self, state: DecodeState) -> DecodeState:
        pc = self.pc
        if pc.mesh is None:
            return state
        return sharding.constrain_state(state, pc.mesh, rules=pc.rules)

    def prefill(self, sp: SamplingParams, cache_len: int, out_len: int):
        return self._memo(("prefill", sp, cache_len, out_len), lambda: jax.jit(self._prefill(sp, cache_len, out_len)))

    def _prefill(self, sp: SamplingParams, cache_len: int, out_len: int):
        pc = self.pc
        cfg = pc.cfg

        def prefill(params, trainable, slot, prefix, tokens, valid, offset, expand, max_len, row_id, key, pool,
                    resume=None):
            """Prefill the distinct prompts, then copy each row's prompt cache (`expand` [B] indexes them).

            prefix [C] holds tokens every distinct prompt starts with (C may be 0); tokens [Bu, S] holds the
            rest of each prompt, left-padded. The prefix runs once and its keys and values are shared by every
            row: slots [0, C) hold the prefix, [C, C + S) each row's padded rest. Positions count real tokens
            (the rest of row u starts at position offset[u]), so the padding between the two changes nothing.

            pool (or None) = (k, v, src [Bu, C']): the prefix cache's keys and values and, for each of the first
            C' slots of each row, the cache slot its key and value come from (-1: none); a row's cached prefix
            is loaded there instead of computed (then C = 0).

            The prefix and the rests run in chunks of prefill_chunk tokens (marl_jax.generate.prefill), so a
            long prompt's attention scores are [Bu, heads, chunk, C + S], not [Bu, heads, S, S].

            resume (or None) = (gen [B, G], out_tokens [B, Tn], out_logp [B, Tn], g [B]): rows preempted after
            generating g > 0 tokens (0: a fresh row). Their first g - 1 tokens (gen, from slot C + S on) are
            prefilled after the prompt, row by row, and they continue from token g - 1 with their step, tokens
            and log-probs as they were: the decode loop then goes on exactly as if they had never stopped."""
            Bu, S = tokens.shape
            C = prefix.shape[0]
            params, lo = self.select(params, trainable, slot)
            run = functools.partial(decoder.forward_cached, params, cfg, lora=lo, lora_scale=pc.spec.scale,
                                    dtype=pc.dtype, last_only=True, mesh=pc.mesh, rules=pc.rules)
            cache = decoder.init_cache(cfg, Bu, cache_len, pc.kv_dtype)
            chunked = functools.partial(prefill_chunks, run, chunk=pc.prefill_chunk)
            if C:
                _, one = chunked(prefix[None], jnp.arange(C)[None], jnp.ones((1, C), bool),
                                 decoder.init_cache(cfg, 1, cache_len, pc.kv_dtype), 0, window=C)
                cache = jax.tree_util.tree_map(lambda x, full: jnp.broadcast_to(x, full.shape), one, cache)
            if pool is not None:
                pk, pv, src = pool
                C = src.shape[1]
                at = jnp.maximum(src, 0)
                k = jnp.take(pk, at, axis=3).transpose(0, 3, 1, 2, 4).astype(cache.k.dtype)  # [L, Bu, H, hd, C]
                v = jnp.take(pv, at, axis=2).transpose(0, 2, 1, 3, 4).astype(cache.v.dtype)  # [L, Bu, H, C, hd]
                cache = KVCache(cache.k.at[..., :C].set(k), cache.v.at[:, :, :, :C].set(v),
                                cache.valid.at[:, :C].set(src >= 0))
            positions = offset[:, None] + jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
            logits, cache = chunked(tokens, positions, valid, cache, C, window=C + S)
            take = lambda x, axis=0: jnp.take(x, expand, axis=axis)
            cache = cache.map_batch(take)
            logits, positions = take(logits[:, -1]), take(positions)
            B = expand.shape[0]
            tok, lp = sample_tokens(logits, row_keys(key, row_id, 0), sp)
            active = (row_id >= 0) & ~jnp.isin(tok, jnp.asarray(sp.stop_ids or (-1,), jnp.int32)) & (max_len > 1)
            out_tokens = jnp.full((B, out_len), pc.pad_id, jnp.int32).at[:, 0].set(tok)
            out_logp = jnp.zeros((B, out_len), jnp.float32).at[:, 0].set(lp)
            pos, step = positions[:, -1] + 1, jnp.ones(B, jnp.int32)
            if resume is not None:
                gen, prev_tokens, prev_logp, g = resume
                G = gen.shape[1]
                gvalid = jnp.arange(G)[None] < (g - 1)[:, None]
                _, cache = chunked(gen, pos[:, None] + jnp.arange(G)[None], gvalid, cache, C + S, window=C + S + G)
                res = g > 0
                tok = jnp.where(res, jnp.take_along_axis(prev_tokens, jnp.maximum(g - 1, 0)[:, None], 1)[:, 0], tok)
                out_tokens = jnp.where(res[:, None], prev_tokens, out_tokens)
                out_logp = jnp.where(res[:, None], prev_logp, out_logp)
                active = jnp.where(res, row_id >= 0, active)
                pos, step = pos + jnp.maximum(g - 1, 0), jnp.where(res, g, step)
            state = DecodeState(cache, tok, pos, step, active, out_tokens, out_logp, row_id, max_len)
            return self.constrain(state)

        return prefill

    def decode(self, sp: SamplingParams, prompt_len: int, window: int):
        """The decode loop (jitted, the state donated) for prompt bucket `prompt_len` and attention `window`."""
        return self._memo(("decode", sp, prompt_len, window),
                          lambda: jax.jit(self.decode_loop(sp, prompt_len, window), donate_argnums=(3,)))

    def decode_loop(self, sp: SamplingParams, prompt_len: int, window: int):
        """The decode loop as a function (decode() jits it; benchmarks compile it for other devices)."""
        pc = self.pc
        cfg = pc.cfg
        stops = jnp.asarray(sp.stop_ids or (-1,), jnp.int32)

        def decode(params, trainable, slot, state: DecodeState, key, min_active, max_steps):
            """Decode until no row is live, the live rows are at most `min_active` (the host then refills
            or compacts), `max_steps` steps have run (the host compacts a long tail more tightly) or a live
            row's next cache slot leaves the attention window. Each row counts its
            own tokens (`step` [B]), so rows that joined later decode beside older ones.

            Paged cache: a row's token at position p sits in slot p (its valid slots are a prefix, what the
            TPU paged-attention kernel reads); a live row entering a block it does not hold yet pops one from
            its shard's free stack; the loop also exits when a stack cannot serve the next step (the host
            grows the pool)."""
            params, lo = self.select(params, trainable, slot)
            B, Tn = state.out_tokens.shape
            rows = jnp.arange(B)
            paged = isinstance(state.cache, PagedCache)

            def slot(s):  # the cache slot each row's next token goes to (paged rows keep slot = position)
                return s.pos if paged else prompt_len + s.step - 1

            def wanted(s):  # rows whose next slot lies in a block they do not hold yet
                j = slot(s) // s.cache.block
                cur = s.cache.table[rows, j]
                return j, cur, s.active & (cur == 0)

            def cond(carry):
                s, it = carry
                n = jnp.sum(s.active)
                fits = jnp.all(~s.active | (slot(s) < window))  # next slots inside the window
                if paged:
                    fits &= jnp.all(s.cache.top >= wanted(s)[2].reshape(s.cache.shards, -1).sum(1))
                return (n > 0) & (n > min_active) & (it < max_steps) & fits

            def allocate(s):
                c = s.cache
                j, cur, need = wanted(s)
                need2 = need.reshape(c.shards, -1)  # rows by shard: each pops from its own stack
                rank = jnp.cumsum(need2, axis=1) - 1
                at = jnp.clip(c.top[:, None] - 1 - rank, 0, c.free.shape[1] - 1)
                got = jnp.take_along_axis(c.free, at, axis=1).reshape(-1)
                return c._replace(table=c.table.at[rows, j].set(jnp.where(need, got, cur)),
                                  top=c.top - jnp.sum(need2, axis=1, dtype=jnp.int32))

            def body(carry):
                s, it = carry
                logits, cache = decoder.forward_cached(
                    params, cfg, s.token[:, None], s.pos[:, None], allocate(s) if paged else s.cache, slot(s),
                    s.active[:, None], lora=lo, lora_scale=pc.spec.scale, dtype=pc.dtype, window=window,
                    mesh=pc.mesh, rules=pc.rules)
                tok, lp = sample_tokens(logits[:, 0], row_keys(key, s.row_id, s.step), sp)
                tok = jnp.where(s.active, tok, pc.pad_id)
                lp = jnp.where(s.active, lp, 0.0)
                at = jnp.where(s.active, s.step, Tn)  # finished rows write nowhere
                out_tokens = s.out_tokens.at[rows, at].set(tok, mode="drop")
                out_logp = s.out_logp.at[rows, at].set(lp, mode="drop")
                active = s.active & ~jnp.isin(tok, stops) & (s.step + 1 < s.max_len)
                step = s.step + s.active
                return DecodeState(cache, tok, s.pos + s.active, step, active, out_tokens, out_logp,
                                   s.row_id, s.max_len), it + 1

            state, it = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
            return self.constrain(state), it

        return decode

    def gather(self):
        """Rows `idx` of the state (compaction); rows with keep False become fillers."""
        def gather(state: DecodeState, idx, keep):
            take = lambda x, axis=0: jnp.take(x, idx, axis=axis)
            cache = state.cache.map_batch(take)
            return self.constrain(DecodeState(
                cache, take(state.token), take(state.pos), take(state.step), take(state.active) & keep,
                take(state.out_tokens), take(state.out_logp), jnp.where(keep, take(state.row_id), -1),
                take(state.max_len)))
        return self._memo("gather", lambda: jax.jit(gather))

    def insert(self):
        """Rows of a freshly prefilled state into rows `dest` of the running one (dest = B: dropped)."""
        def insert(state: DecodeState, new: DecodeState, dest):
            put = lambda x, y, axis=0: x.at[(slice(None),) * axis + (dest,)].set(y, mode="drop")
            cache = KVCache(put(state.cache.k, new.cache.k, 1), put(state.cache.v, new.cache.v, 1),
                            put(state.cache.valid, new.cache.valid))
            return self.constrain(DecodeState(cache, *(put(a, b) for a, b in zip(state[1:], new[1:]))))
        return self._memo("insert", lambda: jax.jit(insert, donate_argnums=(0,)))

    def paged_insert(self):
        """Rows of a freshly prefilled dense state (prompt slots only) into rows `dest` of the paged state
        (dest = B: dropped), their prompt keys and values into the blocks `write` names in their shard `shard`
        (a shared block that earlier rows filled and still read is not written again), with their block tables
        `table` and the pool's free stacks `free`, `top` as the host's block pool has them now.

        The dense prefill lays a row out with holes (a shared or cached prefix, then the rest left-padded);
        the pool holds it compacted: the n-th valid slot goes to slot n, so a row's token at position p is in
        slot p and its valid slots are a prefix (the paged-attention kernel's model). Padding slots write the
        null block."""
        def insert(state: DecodeState, new: DecodeState, dest, table, write, shard, free, top):
            c, nc = state.cache, new.cache
            t = jnp.where(nc.valid, jnp.cumsum(nc.valid, axis=1) - 1, 0)  # [Bg, P] each slot's compact slot
            blocks = jnp.where(nc.valid, jnp.take_along_axis(write, t // c.block, axis=1), 0)
            off = t % c.block

            def put_kv(pool, x):  # x [Hkv, L, Bg, P, hd]; each shard writes its own rows, the rest its null block
                return jax.vmap(lambda p, d: p.at[:, :, jnp.where(shard[:, None] == d, blocks, 0), off].set(x),
                                in_axes=(2, 0), out_axes=2)(pool, jnp.arange(c.shards))

            k = put_kv(c.k, nc.k.transpose(2, 0, 1, 4, 3).astype(c.k.dtype))  # [L, Bg, H, hd, P] -> [H, L, Bg, P, hd]
            v = put_kv(c.v, nc.v.transpose(2, 0, 1, 3, 4).astype(c.v.dtype))  # [L, Bg, H, P, hd] -> [H, L, Bg, P, hd]
            put = lambda x, y: x.at[dest].set(y, mode="drop")
            cache = c._replace(k=k, v=v, table=put(c.table, table), free=free, top=top)
            return self.constrain(DecodeState(cache, *(put(a, b) for a, b in zip(state[1:], new[1:]))))
        return self._memo("paged_insert", lambda: jax.jit(insert, donate_argnums=(0,)))

    def empty_paged(self, B: int, blocks: int, block: int, length: int, shards: int, out_len: int):
        """A state of B filler rows over an empty paged pool (`blocks` blocks per shard): a program of its own,
        so that the sampler's warm-up can compile it."""
        pc = self.pc

        def empty():
            cache = decoder.init_paged(pc.cfg, blocks, block, B, length, shards, pc.kv_dtype)
            z = jnp.zeros(B, jnp.int32)
            return self.constrain(DecodeState(cache, z, z, jnp.ones(B, jnp.int32), jnp.zeros(B, bool),
                                              jnp.full((B, out_len), pc.pad_id, jnp.int32),
                                              jnp.zeros((B, out_len), jnp.float32), jnp.full(B, -1, jnp.int32), z))
        return self._memo(("empty_paged", B, blocks, block, length, shards, out_len), lambda: jax.jit(empty))

    def grow(self, N: int):
        """The pool's keys and values with blocks added up to N per shard."""
        def grow(k, v):
            pad = lambda x: jnp.concatenate([x, jnp.zeros(x.shape[:3] + (N - x.shape[3],) + x.shape[4:], x.dtype)], 3)
            return pad(k), pad(v)
        return self._memo(("grow", N), lambda: jax.jit(grow))

    def store(self):
        """Slots `slots` of rows `rows` of the decode cache into prefix-cache slots `dst` (pk [L, H, hd, n],
        pv [L, H, n, hd], donated)."""
        def store(pk, pv, cache, rows, slots, dst):
            if isinstance(cache, PagedCache):  # a row's slot lives in its shard's block its table names
                D = cache.shards
                shard = rows // (cache.table.shape[0] // D)
                blocks, off = cache.table[rows, slots // cache.block], slots % cache.block

                def take(pool):  # each shard reads its rows (the rest its null block), then one sum over shards
                    parts = jax.vmap(lambda p, d: jnp.where((shard == d)[None, None, :, None],
                                                            p[:, :, jnp.where(shard == d, blocks, 0), off], 0),
                                     in_axes=(2, 0))(pool, jnp.arange(D))  # [D, H, L, M, hd]
                    return parts.sum(0).transpose(2, 1, 0, 3)  # [M, L, H, hd]
                k, v = take(cache.k), take(cache.v)
            else:
                k = cache.k[:, rows, :, :, slots]  # [M, L, H, hd]
                v = cache.v[:, rows, :, slots, :]  # [M, L, H, hd]
            pk = pk.at[:, :, :, dst].set(k.transpose(1, 2, 3, 0).astype(pk.dtype), mode="drop")
            pv = pv.at[:, :, dst, :].set(v.transpose(1, 2, 0, 3).astype(pv.dtype), mode="drop")
            if self.pc.mesh is not None:  # the shardings the prefix cache starts with: one store program
                pk, pv = (sharding.constrain(x, n, self.pc.mesh, self.pc.rules) for x, n in zip((pk, pv), PREFIX_AXES))
            return pk, pv
        return self._memo("store", lambda: jax.jit(store, donate_argnums=(0, 1)))
