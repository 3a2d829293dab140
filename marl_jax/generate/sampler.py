"""Batched sampling: a jitted prefill, then a jitted `lax.while_loop` decode over a fixed KV cache.

Shapes are bucketed (batch to 2^k and 3 * 2^k, prompt and new-token lengths to 16 * {1, 1.5} * 2^k), so a
run compiles a handful of programs whatever its inputs.

Prefill: the distinct prompts (a task's episodes share one) run at their own bucketed count, in chunks of
`prefill_chunk` tokens against the cache (marl_jax.generate.prefill), so its memory grows linearly with the
prompt; each row then gets a copy of its prompt's cache for decoding.

Continuous batching: a call's rows (any number) go through one batch of at most `max_batch` rows. Each
row counts its own tokens and writes its own cache slot, so when an eighth of the rows have finished
the loop exits, the host harvests them and prefills waiting prompts into their places (programs: one
prefill per refill bucket, one insert). When nothing waits, the tail is compacted: once the live rows
fit the next smaller batch bucket, the host gathers them into it. Attention reads a window of the
cache (a quarter, a half, then all of the new-token slots) so early steps skip the cache's empty end.

KV memory, dense (the default): the decode cache holds min(rows, max_batch) (bucketed) rows x (P + Tn)
slots, P the call's prompt bucket and Tn the new-token bucket, whatever the number of rows in the call:
for 256 rollout rows and max_batch 64, a quarter of a dense cache for every row.

KV memory, paged (`paged=True`): keys and values live in a pool of `kv_block`-slot blocks (PagedCache);
a row holds a block only where it has tokens: the blocks its prompt fills when it is admitted, then one
more each time its completion enters a new block (popped from a free stack inside the jitted loop), all
returned when it is harvested. Rows with the same prompt (a task's episodes) share the prompt's blocks
that lie wholly before the first completion slot, counted per row and returned with the last one. Blocks
held at any time <= sum over live distinct prompts of their blocks + sum over live rows of (1 + tokens
generated / kv_block + 1); the pool grows (in 1.5x steps, so few shapes compile) when the free
blocks could run out on the next step, and never beyond the dense cache's B x (P + Tn) slots. Attention
gathers each row's blocks through its block table, so a row reads only its own blocks (and the null
block, masked, where it holds none). Compaction moves block-table rows, not keys and values. On this
CPU the gather makes decode ~15% slower than the dense cache, so it is off by default; it is what to
turn on when the dense cache does not fit. Under a mesh the pool has a part per row shard (the devices
rows are split over): a row's blocks come from its shard's part, reads and writes are vmapped over the
shard axis so that each device touches only its own blocks (no pool-sized collective), compaction keeps
rows in their shard, and KV heads are split over "model".

The prefix cache (PrefixCache) adds a fixed `prefix_cache_tokens` slots of keys and values.

Prefix reuse: a prompt that extends an earlier call's prompt + completion (an eval_opt round, a
synthesizer's prompt embedding its workers' transcripts, every episode of a task) loads the cached
blocks of that prefix instead of prefilling it; the cache empties when the parameters change.

Randomness is keyed per (row, token index), so a row's sample does not depend on which other rows
share its batch or on compaction; the same key gives the same completions.

Log-probs are of the sampled token under softmax(logits / temperature) (plain softmax for greedy),
before top-k / top-p truncation: the distribution a teacher-forced training pass recomputes.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.generate.prefill import PREFILL_CHUNK, prefill_chunks
from marl_jax.models import decoder
from marl_jax.models.decoder import KVCache, ModelConfig, PagedCache
from marl_jax.models import sharding
from marl_jax.models.sharding import to_host


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


def paged_first_pool(rows: int, distinct: int, P: int, Tn: int, block: int) -> int:
    """Blocks of a row shard's first paged pool: its distinct prompts' whole blocks once, each row's part
    of its prompt's last block and one block of growth (+1 null), rounded up to a size bucket, at most
    a dense cache of the rows (marl_jax.plan replays this)."""
    whole, per = P // block, -(-P // block)
    full = 1 + rows * -(-(P + Tn) // block)
    return min(_batch_bucket(1 + distinct * whole + rows * (per - whole + 1), 16), full)


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


def _row_keys(key, row_id, step):
    """A key per row from (row id, token index); step is a scalar or one index per row."""
    step = jnp.broadcast_to(step, row_id.shape)
    return jax.vmap(lambda r, t: jax.random.fold_in(jax.random.fold_in(key, r), t))(row_id, step)



class PrefixCache:
    """Keys and values of earlier calls' sequences (prompt + completion), kept on the device in blocks of
    `block` tokens and found again by their tokens, so that a later prompt extending one is not prefilled again.

    Blocks form a trie: a block's key is (its parent block's node, its `block` tokens), the root being the
    policy slot, so a block stands for the whole prefix up to its end, as in vLLM's prefix caching. Memory is
    bounded: `num_blocks` blocks of keys and values ([L, Hkv, hd, num_blocks * block] and the transpose),
    allocated at the first store; when full, the least recently used block is reused (children are touched
    before their parents, so a prefix's tail goes before its head). Keys and values depend on the
    parameters, so the cache empties whenever `generate` gets another params or trainable object.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block: int = 16, dtype=jnp.float32):
        if num_blocks < 1 or block < 1:
            raise ValueError(f"prefix cache needs num_blocks >= 1 and block >= 1, got {num_blocks}, {block}")
        self.cfg, self.num_blocks, self.block, self.dtype = cfg, num_blocks, block, dtype
        self.k = self.v = None
        self._owner: tuple = ()
        self.clear()

    def clear(self):
        self.nodes: collections.OrderedDict = collections.OrderedDict()  # (parent node, tokens) -> (node, block), LRU first
        self.free = list(range(self.num_blocks))
        self._next_node = 0
        self.pinned: set = set()  # blocks a running call will still load: never evicted meanwhile

    def bind(self, *objs):
        """Empty the cache unless these (the params and trainable objects) are the ones it was filled with."""
        if len(objs) != len(self._owner) or any(a is not b for a, b in zip(objs, self._owner)):
            self.clear()
            self._owner = objs

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else self.k.nbytes + self.v.nbytes

    def lookup(self, slot: int, tokens: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of `tokens`, leaving at least its last token uncached
        (its logits start decoding)."""
        parent, found, keys = ("slot", slot), [], []
        for i in range((len(tokens) - 1) // self.block):
            key = (parent, tuple(tokens[i * self.block:(i + 1) * self.block]))
            hit = self.nodes.get(key)
            if hit is None:
                break
            parent = hit[0]
            found.append(hit[1])
            keys.append(key)
        for key in reversed(keys):  # the head ends most recently used
            self.nodes.move_to_end(key)
        return found

    def reserve(self, slot: int, tokens: Sequence[int], taken: set) -> list[tuple[int, int]]:
        """(token start, block) for each full block of `tokens` not cached yet, evicting least recently used
        blocks; `taken` holds blocks this store walked through, which, like pinned ones, are never evicted
        (the store stops when nothing else is left)."""
        parent, new, keys = ("slot", slot), [], []
        for i in range(len(tokens) // self.block):
            key = (parent, tuple(tokens[i * self.block:(i + 1) * self.block]))
            hit = self.nodes.get(key)
            if hit is None:
                if not self.free:
                    victim = next((k for k, (_, b) in self.nodes.items() if b not in taken and b not in self.pinned),
                                  None)
                    if victim is None:
                        break
                    self.free.append(self.nodes.pop(victim)[1])
                hit = (self._next_node, self.free.pop())
                self._next_node += 1
                self.nodes[key] = hit
                new.append((i * self.block, hit[1]))
            self.nodes.move_to_end(key)  # most recently used: not evicted by this walk
            taken.add(hit[1])
            parent = hit[0]
            keys.append(key)
        for key in reversed(keys):
            self.nodes.move_to_end(key)
        return new

    def ensure(self):
        if self.k is None:
            c, n = self.cfg, self.num_blocks * self.block
            self.k = jnp.zeros((c.num_layers, c.num_kv_heads, c.head_dim, n), self.dtype)
            self.v = jnp.zeros((c.num_layers, c.num_kv_heads, n, c.head_dim), self.dtype)


class Sampler:
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
                 max_batched_tokens: int = 0, check_blocks: bool = False):
        from marl_jax.policy.lora import PolicySpec

        self.cfg = cfg
        self.spec = spec or PolicySpec()
        self.lora_scale = self.spec.scale
        self.dtype = dtype
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
        self.prefix_cache = (PrefixCache(cfg, -(-prefix_cache_tokens // prefix_block), prefix_block, dtype)
                             if prefix_cache_tokens > 0 else None)

    def _select(self, params, trainable, slot):
        if trainable is None:
            return params, None
        from marl_jax.policy.lora import slot_params
        return slot_params(self.spec, params, trainable, slot)

    # ---- jitted programs (built once per static signature) ----
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
            cache = decoder.init_cache(cfg, Bu, cache_len, self.dtype)
            chunked = functools.partial(prefill_chunks, run, chunk=self.prefill_chunk)
            if C:
                _, one = chunked(prefix[None], jnp.arange(C)[None], jnp.ones((1, C), bool),
                                 decoder.init_cache(cfg, 1, cache_len, self.dtype), 0, window=C)
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

            Paged cache: a live row entering a block it does not hold yet pops one from its shard's free
            stack; the loop also exits when a stack cannot serve the next step (the host grows the pool)."""
            params, lo = self._select(params, trainable, slot)
            B, Tn = state.out_tokens.shape
            rows = jnp.arange(B)
            paged = isinstance(state.cache, PagedCache)

            def wanted(s):  # rows whose next slot lies in a block they do not hold yet
                j = (prompt_len + s.step - 1) // s.cache.block
                cur = s.cache.table[rows, j]
                return j, cur, s.active & (cur == 0)

            def cond(carry):
                s, it = carry
                n = jnp.sum(s.active)
                fits = jnp.all(~s.active | (prompt_len + s.step - 1 < window))  # next slots inside the window
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
                    params, cfg, s.token[:, None], s.pos[:, None], allocate(s) if paged else s.cache,
                    prompt_len + s.step - 1,
                    s.active[:, None], lora=lo, lora_scale=self.lora_scale, dtype=self.dtype, window=window,
                    mesh=self.mesh, rules=self.rules)
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

    # ---- host driver ----
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
                      "refills": 0, "stored_tokens": 0, "peak_kv_bytes": 0}
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
        S = length_bucket(max(len(p) - cached.get(p, 0) for p in uniq))
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
                state = self._make_room(state, P, queue)
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
                    state = self._ensure_blocks(state, self._blocks_wanted(state, P))
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

    # ---- admission under the KV budget and the token cap, preemption by recompute ----
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
            spans = [self._spans(prompts[i], plan["cached"].get(tuple(prompts[i]), 0), plan["P"], M, g)
                     for i, g in zip(cand[:n], glen)]
            need = self._admission_need(shard, [prompts[i] for i in cand[:n]], spans, plan["P"], D)
            room = to_host(c.top) - self._blocks_wanted(state, plan["P"]) - max(1, (c.k.shape[2] - 1) // 100)
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

    def _make_room(self, state: DecodeState, P: int, queue) -> DecodeState:
        """Under a KV budget: while a shard's free blocks cannot serve its live rows' next step, preempt the row
        admitted last in that shard (vLLM's recompute preemption): its tokens and log-probs so far are kept on
        the host, its blocks go back, and it waits at the front of the queue to be prefilled again."""
        need = self._blocks_wanted(state, P)
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
            need, top = self._blocks_wanted(state, P), to_host(state.cache.top)
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
        worst = max(len(self._spans(p, plan["cached"].get(tuple(p), 0), plan["P"], M, int(n)))
                    for p, n in zip(prompts, limits))
        if worst > N - 1:
            per = self._block_bytes()
            raise ValueError(
                f"one row needs {worst} KV blocks ({worst * per / 2**30:.3f} GiB: its prompt and up to "
                f"{int(max(limits))} new tokens) but the KV budget holds {N - 1} "
                f"({self.kv_budget_bytes / 2**30:.3f} GiB per device): raise --config.rollout.kv_budget_gb to at "
                f"least {(worst + 1) * per / 2**30 * 1.01:.3f}, or lower --config.rollout.max_new_tokens or the "
                "prompt's length")

    def _block_bytes(self) -> int:
        """Bytes of one KV block (keys and values, every layer) on one device: KV heads split over "model"."""
        c = self.cfg
        m = 1 if self.mesh is None else self.mesh.shape.get("model", 1)
        heads = c.num_kv_heads // m if c.num_kv_heads % m == 0 else c.num_kv_heads
        return 2 * c.num_layers * self.kv_block * heads * c.head_dim * jnp.dtype(self.dtype).itemsize

    def _count_kv(self, state: DecodeState):
        """Peak KV bytes: the decode cache as allocated (the pool, when paged) and, paged, the blocks in use."""
        c = state.cache
        self.stats["peak_kv_bytes"] = max(self.stats["peak_kv_bytes"], c.k.nbytes + c.v.nbytes)
        if isinstance(c, PagedCache):
            D, N = c.shards, c.k.shape[2]
            used = int((N - 1 - to_host(c.top)).sum())
            self.stats["peak_kv_live_bytes"] = max(self.stats.get("peak_kv_live_bytes", 0),
                                                   (c.k.nbytes + c.v.nbytes) * used // (D * N))

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

    # ---- paged KV (Sampler(paged=True)) ----
    def _empty_paged(self, B: int, P: int, Tn: int, sp: SamplingParams, first: Sequence[Sequence[int]] = ()
                     ) -> DecodeState:
        blk, D = self.kv_block, self.data_size
        T = -(-(P + Tn) // blk) * blk
        # Per shard, a first pool for its first rows' prompts (the whole blocks of a prompt once, as its rows
        # share them) and a block of growth per row; it grows as rows need more, never beyond a dense cache
        # of the shard's rows.
        self._pool_rows = B // D
        distinct = max([len({tuple(p) for p in first[d * (B // D):(d + 1) * (B // D)]}) for d in range(D)]
                       + [0]) if first else B // D
        blocks = paged_first_pool(B // D, distinct, P, Tn, blk)
        if self.kv_budget_bytes:  # a fixed pool: the budget's blocks (block 0 the null one), at most a dense cache's
            blocks = max(2, min(self.kv_budget_bytes // self._block_bytes(), 1 + (B // D) * (T // blk)))
        # Host bookkeeping of shared prompt blocks, by (shard, block): rows holding each, and the blocks of
        # each (shard, prompt).
        self._refs: dict[tuple, int] = {}
        self._shared: dict[tuple, dict[int, int]] = {}
        self._block_key: dict[tuple, tuple] = {}
        cache = decoder.init_paged(self.cfg, blocks, blk, B, T, D, self.dtype)
        z = lambda: jnp.zeros(B, jnp.int32)  # distinct buffers: the state is donated
        return DecodeState(cache, z(), z(), jnp.ones(B, jnp.int32), jnp.zeros(B, bool),
                           jnp.full((B, Tn), self.pad_id, jnp.int32), jnp.zeros((B, Tn), jnp.float32),
                           jnp.full(B, -1, jnp.int32), z())

    @staticmethod
    def _blocks_wanted(state: DecodeState, P: int) -> np.ndarray:
        """Blocks the next decode step takes, per shard: live rows whose next slot is in a block they do not hold."""
        c = state.cache
        step, active, table = to_host(state.step), to_host(state.active), to_host(c.table)
        j = np.minimum((P + step - 1) // c.block, table.shape[1] - 1)
        need = active & (table[np.arange(len(step)), j] == 0)
        return need.reshape(c.shards, -1).sum(1)

    @staticmethod
    def _free_lists(c: PagedCache) -> list[list[int]]:
        free, top = to_host(c.free), to_host(c.top)
        return [free[d, :top[d]].tolist() for d in range(c.shards)]

    @staticmethod
    def _with_free(c: PagedCache, lists: list[list[int]]) -> PagedCache:
        free = np.zeros(c.free.shape, np.int32)
        for d, f in enumerate(lists):
            free[d, :len(f)] = f
        return c._replace(free=jnp.asarray(free), top=jnp.asarray(np.array([len(f) for f in lists], np.int32)))

    def _ensure_blocks(self, state: DecodeState, need) -> DecodeState:
        """Grow the pool (to the next size bucket, so few shapes compile) until every shard has `need[d]` blocks
        free; never beyond the blocks a dense cache of a shard's rows would hold (at that size a row wanting a
        block always finds one: together the rows hold fewer than all their slots' blocks)."""
        c = state.cache
        need = np.broadcast_to(np.asarray(need), (c.shards,))
        top, N = to_host(c.top), c.k.shape[2]
        if (top >= need).all():
            return state
        if self.kv_budget_bytes:  # admission and preemption keep within the fixed pool
            raise RuntimeError(f"KV budget pool short of {need.tolist()} blocks with {top.tolist()} free")
        full = 1 + self._pool_rows * c.table.shape[1]
        newN = min(_batch_bucket(N + max(int((need - top).max()), N // 2), 16), full)
        if (newN - N + top < need).any():
            raise RuntimeError(f"paged KV pool cannot hold {need.tolist()} more blocks ({N} per shard, at most {full})")
        lists = [list(range(newN - 1, N - 1, -1)) + f for f in self._free_lists(c)]
        k, v = self._grow_fn(newN)(c.k, c.v)
        self.stats["pool_grows"] += 1
        return state._replace(cache=self._with_free(c._replace(k=k, v=v, free=jnp.zeros((c.shards, newN), jnp.int32)),
                                                    lists))

    def _grow_fn(self, N: int):
        key_ = ("grow", N)
        if key_ not in self._fns:
            def grow(k, v):
                pad = lambda x: jnp.concatenate([x, jnp.zeros(x.shape[:2] + (N - x.shape[2],) + x.shape[3:], x.dtype)], 2)
                return pad(k), pad(v)
            self._fns[key_] = jax.jit(grow)
        return self._fns[key_]

    def _spans(self, p, cached: int, P: int, M: int, g: int = 0) -> np.ndarray:
        """Blocks a row's cache fills when it is admitted: slots [0, cached), the rest of its prompt right-aligned
        to P and, for a row preempted after g tokens, its g - 1 tokens from slot P on."""
        blk = self.kv_block
        filled = np.zeros(M * blk, bool)
        filled[:cached] = True
        filled[P - (len(p) - cached):P + max(g - 1, 0)] = True
        return np.flatnonzero(filled.reshape(M, blk).any(1))

    def _admission_need(self, shard, prompts, spans, P: int, D: int) -> np.ndarray:
        """Fresh blocks each shard gives rows admitted in this order ([n, D], cumulative). Rows with the same
        prompt in the same shard (a task's episodes) share its blocks that lie wholly before slot P, which no
        row writes again; the block holding slot P, where completions start, is each row's own."""
        whole = P // self.kv_block
        need = np.zeros((len(prompts), D), np.int64)
        acc = np.zeros(D, np.int64)
        fresh = set()
        for i, (d, p, js) in enumerate(zip(shard, prompts, spans)):
            key_p = (int(d), tuple(p))
            for j in js:
                if j >= whole:
                    acc[d] += 1
                elif j not in self._shared.get(key_p, {}) and (key_p, int(j)) not in fresh:
                    fresh.add((key_p, int(j)))
                    acc[d] += 1
            need[i] = acc
        return need

    def _admit(self, params, trainable, slot, plan, sp, Tn, prompts, row_ids, limits, dest, state, key, gens=None):
        """Paged: prefill `prompts` (a dense cache of the prompt slots only, and of the tokens preempted rows had
        generated, `gens`), give each row blocks of its shard for the slots it fills, and write the rows into batch
        rows `dest` of the running state."""
        P, blk, n = plan["P"], self.kv_block, len(prompts)
        gens = gens if gens is not None else [None] * n
        glen = [0 if x is None else len(x[0]) for x in gens]
        G = resume_slots(max(glen)) if any(glen) else 0
        Bg = _batch_bucket(n, 1, self.data_size)
        new = self._prefill(params, trainable, int(slot), plan, sp, Tn, prompts, row_ids, limits, Bg, key,
                            cache_len=P + G, gens=gens + [None] * (Bg - n))
        c = state.cache
        B, M, D = state.active.shape[0], c.table.shape[1], c.shards
        shard = np.asarray(dest) // (B // D)
        spans = [self._spans(p, self._layout[int(r)][0], P, M, g) for r, p, g in zip(row_ids, prompts, glen)]
        need = self._admission_need(shard, prompts, spans, P, D)[-1]
        whole = P // blk
        fresh = {(int(d), tuple(p), int(j)) for d, p, js in zip(shard, prompts, spans) for j in js
                 if j < whole and j not in self._shared.get((int(d), tuple(p)), {})}
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
                if j >= whole:
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

    def _paged_insert_fn(self):
        """Rows of a freshly prefilled dense state (prompt slots only) into rows `dest` of the paged state
        (dest = B: dropped), their prompt keys and values into the blocks `write` names in their shard `shard`
        (a shared block that earlier rows filled and still read is not written again)."""
        if "paged_insert" not in self._fns:
            def insert(state: DecodeState, new: DecodeState, dest, table, write, shard):
                c, nc = state.cache, new.cache
                Bg, P = nc.valid.shape
                j = jnp.arange(P)
                blocks = write[:, j // c.block]  # [Bg, P]; slots without a block write the null block
                off = jnp.broadcast_to(j % c.block, (Bg, P))

                def put_kv(pool, x):  # x [L, Bg, P, H, hd]; each shard writes its own rows, the rest its null block
                    return jax.vmap(lambda p, d: p.at[:, jnp.where(shard[:, None] == d, blocks, 0), off].set(x),
                                    in_axes=(1, 0), out_axes=1)(pool, jnp.arange(c.shards))

                k = put_kv(c.k, nc.k.transpose(0, 1, 4, 2, 3).astype(c.k.dtype))
                v = put_kv(c.v, nc.v.transpose(0, 1, 3, 2, 4).astype(c.v.dtype))
                valid = jnp.zeros((Bg, c.valid.shape[1]), bool).at[:, :P].set(nc.valid)
                put = lambda x, y: x.at[dest].set(y, mode="drop")
                cache = c._replace(k=k, v=v, table=put(c.table, table), valid=put(c.valid, valid))
                return self._constrain(DecodeState(cache, *(put(a, b) for a, b in zip(state[1:], new[1:]))))
            self._fns["paged_insert"] = jax.jit(insert, donate_argnums=(0,))
        return self._fns["paged_insert"]

    def _check_blocks(self, state: DecodeState):
        """In every shard, every block but the null one is either free or held, by one row or, a shared prompt
        block, by as many rows as its count says: none leaked, none shared by mistake."""
        c = state.cache
        D, N = c.shards, c.k.shape[2]
        table = to_host(c.table).reshape(D, -1, c.table.shape[1])
        for d, free in enumerate(self._free_lists(c)):
            held, count = np.unique(table[d][table[d] > 0], return_counts=True)
            both = np.concatenate([held, np.asarray(free, held.dtype)])
            shared_ok = all(self._refs.get((d, int(b)), 1) == k for b, k in zip(held, count))
            if len(both) != N - 1 or set(both.tolist()) != set(range(1, N)) or not shared_ok:
                raise RuntimeError(f"paged KV bookkeeping broken in shard {d}: {len(held)} blocks held, "
                                   f"{len(free)} free, pool of {N - 1}, shared counts {'ok' if shared_ok else 'wrong'}")

    def _release(self, state: DecodeState, done: np.ndarray) -> DecodeState:
        """Paged: harvested rows give their blocks back to their shard and become fillers (row id -1)."""
        c = state.cache
        table = to_host(c.table).copy()
        lists = self._free_lists(c)
        per = len(table) // c.shards
        for r in np.flatnonzero(done):
            d = int(r) // per
            for b in table[r][table[r] > 0].tolist():
                if (d, b) in self._refs:  # a shared prompt block goes back when its last row does
                    self._refs[(d, b)] -= 1
                    if self._refs[(d, b)]:
                        continue
                    del self._refs[(d, b)]
                    self._shared.pop(self._block_key.pop((d, b)), None)
                lists[d].append(b)
        table[done] = 0
        rid = np.where(done, -1, to_host(state.row_id)).astype(np.int32)
        return state._replace(row_id=jnp.asarray(rid), active=jnp.asarray(to_host(state.active) & ~done),
                              cache=self._with_free(c._replace(table=jnp.asarray(table)), lists))

    @staticmethod
    def _windows(P: int, Tn: int) -> tuple[int, ...]:
        """Attention windows (cache slots attended) for prompt bucket P: a quarter, a half and all of the
        new tokens, so early steps, where most row-steps are, skip the cache's empty end. Each window is
        a decode program to compile, so they are used only where the new tokens are most of the cache
        (long completions after short prompts); otherwise the one window is the whole cache."""
        if Tn < max(64, P):
            return (P + Tn,)
        return (P + Tn // 4, P + Tn // 2, P + Tn)

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
