"""The sampler's KV memory: the dense cache, the paged pool and its block bookkeeping, the KV budget, and the
prefix cache of earlier calls' sequences.

Dense (the default): the decode cache holds min(rows, max_batch) (bucketed) rows x (P + Tn) slots, P the call's
prompt bucket and Tn the new-token bucket, whatever the number of rows in the call.

Paged (`paged=True`): keys and values live in a pool of `kv_block`-slot blocks (PagedCache); a row holds a
block only where it has tokens: the blocks its prompt fills when it is admitted, then one more each time its
completion enters a new block (popped from a free stack inside the jitted loop), all returned when it is
harvested. A row's token at position p sits in its slot p: its valid slots are a prefix, with no padding, which
is what jax's Pallas paged-attention kernel reads (TPU decode). Rows with the same prompt (a task's episodes)
share the prompt's blocks that lie wholly before its first completion slot, counted per row and returned with
the last one. Without a budget the pool grows (in
1.5x steps, so few shapes compile) when the free blocks could run out on the next step, never beyond the dense
cache's B x (P + Tn) slots. Attention gathers each row's blocks through its block table; compaction moves
block-table rows, not keys and values. Under a mesh the pool has a part per row shard (the devices rows are
split over): a row's blocks come from its shard's part, and KV heads are split over "model".

KV budget (`kv_budget_bytes`, rollout.kv_budget_gb): the pool is fixed at the budget's blocks per device and
never grows; the scheduler admits rows while their blocks fit and preempts rows when it runs dry
(marl_jax.generate.scheduler), so the blocks in use never exceed the budget.

The prefix cache (PrefixCache) adds a fixed `prefix_cache_tokens` slots of keys and values: a prompt that
extends an earlier call's prompt + completion (an eval_opt round, a synthesizer's prompt embedding its
workers' transcripts, every episode of a task) loads the cached blocks of that prefix instead of prefilling
it; the cache empties when the parameters change.
"""
from __future__ import annotations

import collections
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from marl_jax.generate.programs import DecodeState, SamplingParams, _batch_bucket
from marl_jax.models import decoder
from marl_jax.models.decoder import ModelConfig, PagedCache
from marl_jax.models.sharding import to_host


def paged_first_pool(rows: int, distinct: int, P: int, Tn: int, block: int) -> int:
    """Blocks of a row shard's first paged pool: its distinct prompts' whole blocks once, each row's part
    of its prompt's last block and one block of growth (+1 null), rounded up to a size bucket, at most
    a dense cache of the rows (marl_jax.plan replays this)."""
    whole, per = P // block, -(-P // block)
    full = 1 + rows * -(-(P + Tn) // block)
    return min(_batch_bucket(1 + distinct * whole + rows * (per - whole + 1), 16), full)


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


class KVMemory:
    """A Sampler's paged pool: sizing, the free stacks, shared prompt blocks and their counts, the budget."""

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
        cache = decoder.init_paged(self.cfg, blocks, blk, B, T, D, self.kv_dtype)
        z = lambda: jnp.zeros(B, jnp.int32)  # distinct buffers: the state is donated
        return DecodeState(cache, z(), z(), jnp.ones(B, jnp.int32), jnp.zeros(B, bool),
                           jnp.full((B, Tn), self.pad_id, jnp.int32), jnp.zeros((B, Tn), jnp.float32),
                           jnp.full(B, -1, jnp.int32), z())

    def _block_bytes(self) -> int:
        """Bytes of one KV block (keys and values, every layer) on one device: KV heads split over "model"."""
        c = self.cfg
        m = 1 if self.mesh is None else self.mesh.shape.get("model", 1)
        heads = c.num_kv_heads // m if c.num_kv_heads % m == 0 else c.num_kv_heads
        return 2 * c.num_layers * self.kv_block * heads * c.head_dim * jnp.dtype(self.kv_dtype).itemsize

    def _count_kv(self, state: DecodeState):
        """Peak KV bytes: the decode cache as allocated (the pool, when paged) and, paged, the blocks in use."""
        c = state.cache
        self.stats["peak_kv_bytes"] = max(self.stats["peak_kv_bytes"], c.k.nbytes + c.v.nbytes)
        if isinstance(c, PagedCache):
            D, N = c.shards, c.k.shape[2]
            used = int((N - 1 - to_host(c.top)).sum())
            self.stats["peak_kv_live_bytes"] = max(self.stats.get("peak_kv_live_bytes", 0),
                                                   (c.k.nbytes + c.v.nbytes) * used // (D * N))

    @staticmethod
    def _blocks_wanted(state: DecodeState) -> np.ndarray:
        """Blocks the next decode step takes, per shard: live rows whose next slot (= the position of their
        last token) is in a block they do not hold."""
        c = state.cache
        pos, active, table = to_host(state.pos), to_host(state.active), to_host(c.table)
        j = np.minimum(pos // c.block, table.shape[1] - 1)
        need = active & (table[np.arange(len(pos)), j] == 0)
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

    def _spans(self, p, M: int, g: int = 0) -> np.ndarray:
        """Blocks a row's cache fills when it is admitted: its prompt's slots [0, len(p)) and, for a row preempted
        after g tokens, its g - 1 tokens after them."""
        n = len(p) + max(g - 1, 0)
        return np.arange(min(-(-n // self.kv_block), M))

    def _shared_blocks(self, p) -> int:
        """Blocks of prompt p that rows with that prompt share: those wholly before its first completion slot
        len(p), which no row writes again; the block holding that slot, and later ones, are each row's own."""
        return len(p) // self.kv_block

    def _admission_need(self, shard, prompts, spans, D: int) -> np.ndarray:
        """Fresh blocks each shard gives rows admitted in this order ([n, D], cumulative). Rows with the same
        prompt in the same shard (a task's episodes) share their prompt's first _shared_blocks(p) blocks."""
        need = np.zeros((len(prompts), D), np.int64)
        acc = np.zeros(D, np.int64)
        fresh = set()
        for i, (d, p, js) in enumerate(zip(shard, prompts, spans)):
            key_p = (int(d), tuple(p))
            whole = self._shared_blocks(p)
            for j in js:
                if j >= whole:
                    acc[d] += 1
                elif j not in self._shared.get(key_p, {}) and (key_p, int(j)) not in fresh:
                    fresh.add((key_p, int(j)))
                    acc[d] += 1
            need[i] = acc
        return need

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
