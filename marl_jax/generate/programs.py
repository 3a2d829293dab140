"""The sampler's jitted programs and the state they carry (the memory they hold is in marl_jax.generate.kv,
the decisions of when to run them in marl_jax.generate.scheduler).

Prefill: the distinct prompts (a task's episodes share one) run at their own bucketed count, in chunks of
`prefill_chunk` tokens against the cache (marl_jax.generate.prefill), so its memory grows linearly with the
prompt; each row then gets a copy of its prompt's cache. Rows preempted under a KV budget come back through
the same program: their prompt is prefilled once per distinct prompt, then each row's tokens generated so far,
and the row continues exactly where it stopped. Decode: a `lax.while_loop` over the batch until the host has
something to do (refill, compaction, a longer attention window, a paged pool short of blocks).

Parameters are arguments of the programs (never closed over), so updating them does not recompile. Shapes are
bucketed (batch to 2^k and 3 * 2^k, prompt and new-token lengths to 16 * {1, 1.5} * 2^k), so a run compiles
a handful of programs whatever its inputs.

Randomness is keyed per (row, token index), so a row's sample does not depend on which other rows share its
batch, on compaction or on preemption; the same key gives the same completions.

Log-probs are of the sampled token under softmax(logits / temperature) (plain softmax for greedy), before
top-k / top-p truncation: the distribution a teacher-forced training pass recomputes.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.generate.prefill import prefill_chunks
from marl_jax.models import decoder
from marl_jax.models import sharding
from marl_jax.models.decoder import KVCache, PagedCache


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k
    stop_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")


class SampleOutput(NamedTuple):
    tokens: np.ndarray  # [N, max_new_tokens] int32, pad_id after each row's length
    logprobs: np.ndarray  # [N, max_new_tokens] float32, 0 after each row's length
    lengths: np.ndarray  # [N] int32, tokens generated (including a stop token)
    finished: np.ndarray  # [N] bool, True when the row ended on a stop token

    def row(self, i: int) -> tuple[list[int], list[float]]:
        n = int(self.lengths[i])
        return self.tokens[i, :n].tolist(), self.logprobs[i, :n].tolist()


class DecodeState(NamedTuple):
    cache: KVCache
    token: jax.Array  # [B] last sampled token (not yet in the cache)
    pos: jax.Array  # [B] position of `token`
    step: jax.Array  # [B] tokens generated so far by each row
    active: jax.Array  # [B] row still generating
    out_tokens: jax.Array  # [B, Tn]
    out_logp: jax.Array  # [B, Tn]
    row_id: jax.Array  # [B] original row index (keys the randomness); -1 for filler rows
    max_len: jax.Array  # [B] per-row new-token limit


def length_bucket(n: int, minimum: int = 16) -> int:
    """Length bucket minimum * {1, 1.5} * 2^k: padding stays under half and only a few shapes compile."""
    b = minimum
    while True:
        if n <= b:
            return b
        if n <= b * 3 // 2:
            return b * 3 // 2
        b *= 2


def resume_slots(g: int) -> int:
    """Cache slots after the prompt that a preempted row's re-prefill covers: its g - 1 tokens, bucketed."""
    return length_bucket(max(g - 1, 1))


def _batch_bucket(n: int, minimum: int = 1, multiple: int = 1, per_octave: int = 2) -> int:
    """Batch size for n rows: `multiple` (the data axis) times 1, 2, 3, 4, 6, 8, 12, ... (2^k and 3 * 2^k),
    at least `minimum`. The 1.5x steps halve the rows compaction pays for between buckets, against
    powers of two, and keep the number of compiled shapes logarithmic. `per_octave` sizes between 2^k and
    2^(k+1) in general (2^k + i 2^k / per_octave): finer buckets waste fewer rows and compile more shapes."""
    need = max(n, minimum, 1)
    c = 1
    while True:
        for m in sorted({c + c * i // per_octave for i in range(per_octave)}):
            if m * multiple >= need:
                return m * multiple
        c *= 2


def _next_smaller_bucket(B: int, minimum: int = 1, multiple: int = 1, per_octave: int = 2) -> int:
    """The largest batch bucket below B and at least `minimum` (0 when there is none)."""
    smaller = [c for c in range(minimum, B) if _batch_bucket(c, minimum, multiple, per_octave) == c]
    return smaller[-1] if smaller else 0


def sample_tokens(logits: jax.Array, keys: jax.Array, sp: SamplingParams) -> tuple[jax.Array, jax.Array]:
    """Pick one token per row from float32 logits [B, V]; returns (tokens [B], log-probs [B])."""
    scaled = logits if sp.temperature == 0.0 else logits / sp.temperature
    if sp.temperature == 0.0:
        tok = jnp.argmax(logits, axis=-1)
    else:
        masked = scaled
        if sp.top_k > 0:
            kth = jax.lax.top_k(scaled, sp.top_k)[0][:, -1:]
            masked = jnp.where(scaled < kth, -jnp.inf, masked)
        if sp.top_p < 1.0:
            srt = -jnp.sort(-masked, axis=-1)
            probs = jax.nn.softmax(srt, axis=-1)
            keep = (jnp.cumsum(probs, axis=-1) - probs) < sp.top_p  # always keeps the top token
            cutoff = jnp.min(jnp.where(keep, srt, jnp.inf), axis=-1, keepdims=True)
            masked = jnp.where(masked < cutoff, -jnp.inf, masked)
        tok = jax.vmap(jax.random.categorical)(keys, masked)
    tok = tok.astype(jnp.int32)
    # log softmax at the chosen token only: the full [B, V] log-softmax costs a pass over the vocabulary.
    picked = jnp.take_along_axis(scaled, tok[:, None], axis=-1)[:, 0]
    return tok, picked - jax.nn.logsumexp(scaled, axis=-1)


def _row_keys(key, row_id, step):
    """A key per row from (row id, token index); step is a scalar or one index per row."""
    step = jnp.broadcast_to(step, row_id.shape)
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(key, r), t))(row_id, step)


class Programs:
    """The jitted programs of a Sampler, built once per static signature and kept in self._fns."""

    def _select(self, params, trainable, slot):
        if trainable is None:
            return params, None
        from marl_jax.policy.lora import slot_params
        return slot_params(self.spec, params, trainable, slot)

    def _constrain(self, state):
        if self.mesh is None:
            return state
        return sharding.constrain_state(state, self.mesh, rules=self.rules)

    def _prefill_fn(self, sp: SamplingParams, cache_len: int, out_len: int):
        key_ = ("prefill", sp, cache_len, out_len)
        if key_ in self._fns:
            return self._fns[key_]
        cfg = self.cfg

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
            params, lo = self._select(params, trainable, slot)
            run = functools.partial(decoder.forward_cached, params, cfg, lora=lo, lora_scale=self.lora_scale,
                                    dtype=self.dtype, last_only=True, mesh=self.mesh, rules=self.rules)
            cache = decoder.init_cache(cfg, Bu, cache_len, self.kv_dtype)
            chunked = functools.partial(prefill_chunks, run, chunk=self.prefill_chunk)
            if C:
                _, one = chunked(prefix[None], jnp.arange(C)[None], jnp.ones((1, C), bool),
                                 decoder.init_cache(cfg, 1, cache_len, self.kv_dtype), 0, window=C)
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
            tok, lp = sample_tokens(logits, _row_keys(key, row_id, 0), sp)
            active = (row_id >= 0) & ~jnp.isin(tok, jnp.asarray(sp.stop_ids or (-1,), jnp.int32)) & (max_len > 1)
            out_tokens = jnp.full((B, out_len), self.pad_id, jnp.int32).at[:, 0].set(tok)
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
            return self._constrain(state)

        fn = jax.jit(prefill)
        self._fns[key_] = fn
        return fn

    def _decode_fn(self, sp: SamplingParams, prompt_len: int, window: int):
        key_ = ("decode", sp, prompt_len, window)
        if key_ in self._fns:
            return self._fns[key_]
        cfg = self.cfg
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
            params, lo = self._select(params, trainable, slot)
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
                    s.active[:, None], lora=lo, lora_scale=self.lora_scale, dtype=self.dtype, window=window,
                    mesh=self.mesh, rules=self.rules, right_padded=paged)
                tok, lp = sample_tokens(logits[:, 0], _row_keys(key, s.row_id, s.step), sp)
                tok = jnp.where(s.active, tok, self.pad_id)
                lp = jnp.where(s.active, lp, 0.0)
                at = jnp.where(s.active, s.step, Tn)  # finished rows write nowhere
                out_tokens = s.out_tokens.at[rows, at].set(tok, mode="drop")
                out_logp = s.out_logp.at[rows, at].set(lp, mode="drop")
                active = s.active & ~jnp.isin(tok, stops) & (s.step + 1 < s.max_len)
                step = s.step + s.active
                return DecodeState(cache, tok, s.pos + s.active, step, active, out_tokens, out_logp,
                                   s.row_id, s.max_len), it + 1

            state, it = jax.lax.while_loop(cond, body, (state, jnp.int32(0)))
            return self._constrain(state), it

        fn = jax.jit(decode, donate_argnums=(3,))
        self._fns[key_] = fn
        return fn

    def _gather_fn(self):
        if "gather" not in self._fns:
            def gather(state: DecodeState, idx, keep):
                take = lambda x, axis=0: jnp.take(x, idx, axis=axis)
                cache = state.cache.map_batch(take)
                return self._constrain(DecodeState(
                    cache, take(state.token), take(state.pos), take(state.step), take(state.active) & keep,
                    take(state.out_tokens), take(state.out_logp), jnp.where(keep, take(state.row_id), -1),
                    take(state.max_len)))
            self._fns["gather"] = jax.jit(gather)
        return self._fns["gather"]

    def _insert_fn(self):
        """Rows of a freshly prefilled state into rows `dest` of the running one (dest = B: dropped)."""
        if "insert" not in self._fns:
            def insert(state: DecodeState, new: DecodeState, dest):
                put = lambda x, y, axis=0: x.at[(slice(None),) * axis + (dest,)].set(y, mode="drop")
                cache = KVCache(put(state.cache.k, new.cache.k, 1), put(state.cache.v, new.cache.v, 1),
                                put(state.cache.valid, new.cache.valid))
                return self._constrain(DecodeState(cache, *(put(a, b) for a, b in zip(state[1:], new[1:]))))
            self._fns["insert"] = jax.jit(insert, donate_argnums=(0,))
        return self._fns["insert"]

    def _paged_insert_fn(self):
        """Rows of a freshly prefilled dense state (prompt slots only) into rows `dest` of the paged state
        (dest = B: dropped), their prompt keys and values into the blocks `write` names in their shard `shard`
        (a shared block that earlier rows filled and still read is not written again).

        The dense prefill lays a row out with holes (a shared or cached prefix, then the rest left-padded);
        the pool holds it compacted: the n-th valid slot goes to slot n, so a row's token at position p is in
        slot p and its valid slots are a prefix (the paged-attention kernel's model). Padding slots write the
        null block."""
        if "paged_insert" not in self._fns:
            def insert(state: DecodeState, new: DecodeState, dest, table, write, shard):
                c, nc = state.cache, new.cache
                Bg, P = nc.valid.shape
                t = jnp.where(nc.valid, jnp.cumsum(nc.valid, axis=1) - 1, 0)  # [Bg, P] each slot's compact slot
                blocks = jnp.where(nc.valid, jnp.take_along_axis(write, t // c.block, axis=1), 0)
                off = t % c.block

                def put_kv(pool, x):  # x [L, Bg, P, H, hd]; each shard writes its own rows, the rest its null block
                    return jax.vmap(lambda p, d: p.at[:, jnp.where(shard[:, None] == d, blocks, 0), off].set(x),
                                    in_axes=(1, 0), out_axes=1)(pool, jnp.arange(c.shards))

                k = put_kv(c.k, nc.k.transpose(0, 1, 4, 2, 3).astype(c.k.dtype))
                v = put_kv(c.v, nc.v.transpose(0, 1, 3, 2, 4).astype(c.v.dtype))
                valid = jnp.arange(c.valid.shape[1])[None] < nc.valid.sum(1)[:, None]
                put = lambda x, y: x.at[dest].set(y, mode="drop")
                cache = c._replace(k=k, v=v, table=put(c.table, table), valid=put(c.valid, valid))
                return self._constrain(DecodeState(cache, *(put(a, b) for a, b in zip(state[1:], new[1:]))))
            self._fns["paged_insert"] = jax.jit(insert, donate_argnums=(0,))
        return self._fns["paged_insert"]

    def _grow_fn(self, N: int):
        key_ = ("grow", N)
        if key_ not in self._fns:
            def grow(k, v):
                pad = lambda x: jnp.concatenate([x, jnp.zeros(x.shape[:2] + (N - x.shape[2],) + x.shape[3:], x.dtype)], 2)
                return pad(k), pad(v)
            self._fns[key_] = jax.jit(grow)
        return self._fns[key_]

    def _store_fn(self):
        if "store" not in self._fns:
            def store(pk, pv, cache, rows, slots, dst):
                if isinstance(cache, PagedCache):  # a row's slot lives in its shard's block its table names
                    D = cache.shards
                    shard = rows // (cache.table.shape[0] // D)
                    blocks, off = cache.table[rows, slots // cache.block], slots % cache.block

                    def take(pool):  # each shard reads its rows (the rest its null block), then one sum over shards
                        parts = jax.vmap(lambda p, d: jnp.where((shard == d)[None, :, None, None],
                                                                p[:, jnp.where(shard == d, blocks, 0), off], 0),
                                         in_axes=(1, 0))(pool, jnp.arange(D))
                        return parts.sum(0).transpose(1, 0, 2, 3)  # [M, L, H, hd]
                    k, v = take(cache.k), take(cache.v)
                else:
                    k = cache.k[:, rows, :, :, slots]  # [M, L, H, hd]
                    v = cache.v[:, rows, :, slots, :]  # [M, L, H, hd]
                pk = pk.at[:, :, :, dst].set(k.transpose(1, 2, 3, 0).astype(pk.dtype), mode="drop")
                pv = pv.at[:, :, dst, :].set(v.transpose(1, 2, 0, 3).astype(pv.dtype), mode="drop")
                return pk, pv
            self._fns["store"] = jax.jit(store, donate_argnums=(0, 1))
        return self._fns["store"]
