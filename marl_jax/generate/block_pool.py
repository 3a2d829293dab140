"""The paged KV pool's host bookkeeping (vLLM's block_pool.py is the model): which blocks of each row shard are
free, which rows hold each shared prompt block, and the rules for how many blocks a row takes. Host only
(numpy): the keys and values live on the device (marl_jax.models.decoder.PagedCache), the decisions of who
runs in marl_jax.generate.scheduler.

A row's token at position p sits in its slot p, slot j of a row in its block table[j // block]. A row holds a
block only where it has tokens: the blocks its prompt fills when it is admitted (`spans`), then one more each
time its completion enters a new block, popped inside the jitted decode loop from its shard's free stack (the
device copy of `free`, uploaded before each decode call; the loop pops from the top, so afterwards the host
keeps the first `top` entries). Rows with the same prompt in the same shard (a task's episodes) share the
prompt's blocks that lie wholly before its first completion slot (`shared_blocks`), counted per row and
returned with the last one. Block 0 of each shard is its null block: never free, never held.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from marl_jax.generate import buckets


class FreeStack:
    """One shard's free blocks as a stack: blocks given back (pushed on top) over the never-used ones [low,
    high), which pop in increasing order; held without a list of every block (a planner's pools have hundreds
    of thousands). As a device array (bottom first): high - 1, ..., low, then the pushed ones."""

    def __init__(self, low: int, high: int):
        self.pushed: list[int] = []
        self.low, self.high = low, high

    def __len__(self) -> int:
        return len(self.pushed) + self.high - self.low

    def pop(self) -> int:
        if self.pushed:
            return self.pushed.pop()
        if self.low >= self.high:
            raise IndexError("pop from an empty free stack")
        self.low += 1
        return self.low - 1

    def append(self, block: int):
        self.pushed.append(block)

    def grow(self, high: int):
        """Blocks [self.high, high) join under the free ones (popped after them)."""
        self.high = high

    def keep(self, n: int):
        """The stack's bottom n blocks: the decode loop popped the rest from the top."""
        drop = len(self) - n
        cut = min(drop, len(self.pushed))
        self.pushed = self.pushed[:len(self.pushed) - cut]
        self.low += drop - cut

    def as_array(self) -> np.ndarray:
        return np.concatenate([np.arange(self.high - 1, self.low - 1, -1), np.asarray(self.pushed, np.int64)])


class BlockPool:
    """Free blocks and shared-block counts of a paged pool of `blocks` blocks per shard over `shards` row shards
    of `rows` rows each, rows addressing `width` blocks. Without a budget the pool grows (buckets.grown_pool_blocks)
    up to `max_blocks`; with one (`fixed`) it never grows and admission and preemption keep within it."""

    def __init__(self, shards: int, blocks: int, block: int, rows: int, width: int, max_blocks: int,
                 fixed: bool = False):
        self.shards, self.block, self.rows, self.width = shards, block, rows, width
        self.max_blocks, self.fixed = max_blocks, fixed
        self.blocks = blocks
        self.free = [FreeStack(1, blocks) for _ in range(shards)]  # block 0 is the null block
        self.refs: dict[tuple[int, int], int] = {}  # (shard, block) -> rows holding a shared prompt block
        self.shared: dict[tuple, dict[int, int]] = {}  # (shard, prompt key) -> {block index j: block}
        self._owner: dict[tuple[int, int], tuple] = {}  # (shard, block) -> its (shard, prompt)

    # ---- the rules ----

    def spans(self, prompt_len: int, generated: int = 0) -> np.ndarray:
        """Block indices a row fills when admitted: its prompt's slots [0, prompt_len) and, for a row preempted
        after `generated` tokens, its generated - 1 tokens after them (the last one is fed back by decode)."""
        n = prompt_len + max(generated - 1, 0)
        return np.arange(min(buckets.blocks_for(n, self.block), self.width))

    def shared_blocks(self, prompt_len: int) -> int:
        """Blocks of a prompt that its rows share: those wholly before its first completion slot prompt_len,
        which no row writes again; the block holding that slot, and later ones, are each row's own."""
        return prompt_len // self.block

    def shard_of(self, slot: int, batch: int) -> int:
        return int(slot) // (batch // self.shards)

    def admission_need(self, shards: Sequence[int], prompts: Sequence[tuple], spans: Sequence[np.ndarray]
                       ) -> np.ndarray:
        """Fresh blocks each shard gives rows admitted in this order ([n, shards], cumulative): a row's own
        blocks, and its prompt's shared blocks unless rows of that prompt in its shard already hold them.
        prompts: (key, length) per row; rows whose prompts have one key share its blocks."""
        need = np.zeros((len(prompts), self.shards), np.int64)
        acc = np.zeros(self.shards, np.int64)
        covered: dict[tuple, int] = {}  # (shard, key) -> shared blocks [0, covered) held or counted already
        for i, (d, (key, n), js) in enumerate(zip(shards, prompts, spans)):
            dk = (int(d), key)
            shared = min(self.shared_blocks(n), len(js))  # spans are a prefix of block indices, so is this
            have = covered.get(dk, len(self.shared.get(dk, ())))
            acc[d] += (len(js) - shared) + max(0, shared - have)
            covered[dk] = max(have, shared)
            need[i] = acc
        return need

    @staticmethod
    def wanted(pos: np.ndarray, active: np.ndarray, table: np.ndarray, shards: int, block: int) -> np.ndarray:
        """Blocks the next decode step takes, per shard: live rows whose next slot (= the position of their last
        token) is in a block they do not hold."""
        j = np.minimum(pos // block, table.shape[1] - 1)
        need = active & (table[np.arange(len(pos)), j] == 0)
        return need.reshape(shards, -1).sum(1)

    def room(self, wanted: np.ndarray) -> np.ndarray:
        """Blocks each shard can give admitted rows: its free ones, less what its running rows take on their
        next step and the watermark."""
        return np.array([len(f) for f in self.free]) - wanted - buckets.watermark(self.blocks)

    def usable(self) -> int:
        """Blocks one row may hold at most (the whole pool but the null block and the watermark)."""
        return self.blocks - 1 - buckets.watermark(self.blocks)

    # ---- the bookkeeping ----

    def device_free(self) -> tuple[np.ndarray, np.ndarray]:
        """The free stacks as the decode loop reads them: free [shards, blocks], top [shards]."""
        free = np.zeros((self.shards, self.blocks), np.int32)
        for d, f in enumerate(self.free):
            free[d, :len(f)] = f.as_array()
        return free, np.array([len(f) for f in self.free], np.int32)

    def popped(self, top: np.ndarray):
        """After a decode call: the loop popped each shard's stack down to top[d]."""
        for f, t in zip(self.free, top):
            f.keep(int(t))

    def free_count(self) -> np.ndarray:
        return np.array([len(f) for f in self.free])

    def grow(self, need: np.ndarray) -> int | None:
        """Make every shard hold need[d] free blocks: the new pool size (new blocks go under the free ones, so
        the old ones are used first), or None when they already do."""
        need = np.broadcast_to(np.asarray(need), (self.shards,))
        top, N = self.free_count(), self.blocks
        if (top >= need).all():
            return None
        if self.fixed:  # admission and preemption keep within the fixed pool
            raise RuntimeError(f"KV budget pool short of {need.tolist()} blocks with {top.tolist()} free")
        newN = buckets.grown_pool_blocks(N, int((need - top).max()), self.max_blocks)
        if (newN - N + top < need).any():
            raise RuntimeError(f"paged KV pool cannot hold {need.tolist()} more blocks ({N} per shard, at most "
                               f"{self.max_blocks})")
        for f in self.free:
            f.grow(newN)
        self.blocks = newN
        return newN

    def assign(self, shards: Sequence[int], prompts: Sequence[tuple], spans: Sequence[np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray]:
        """Blocks for admitted rows (the caller made sure they are free; prompts: (key, length) per row): each
        row's block table [n, width] and the blocks its prefill writes [n, width] (0: none; a shared block that
        earlier rows filled and still read is not written again)."""
        n = len(prompts)
        fresh = {(int(d), key, int(j)) for d, (key, ln), js in zip(shards, prompts, spans) for j in js
                 if j < self.shared_blocks(ln) and j not in self.shared.get((int(d), key), {})}
        table = np.zeros((n, self.width), np.int32)
        write = np.zeros((n, self.width), np.int32)
        for u, (d, (key, ln), js) in enumerate(zip(shards, prompts, spans)):
            d = int(d)
            dk = (d, key)
            mine = self.shared.setdefault(dk, {})
            whole = self.shared_blocks(ln)
            for j in js:
                if j >= whole:  # the row's own block
                    table[u, j] = write[u, j] = self.free[d].pop()
                    continue
                if j not in mine:
                    mine[j] = self.free[d].pop()
                    self._owner[(d, mine[j])] = dk
                if (d, key, int(j)) in fresh:  # filled by this prefill (identical for every row)
                    write[u, j] = mine[j]
                table[u, j] = mine[j]
                self.refs[(d, mine[j])] = self.refs.get((d, mine[j]), 0) + 1
        return table, write

    def release(self, shard: int, blocks: Sequence[int]):
        """A row's blocks go back to its shard; a shared prompt block only with the last row holding it."""
        for b in blocks:
            b = int(b)
            if b == 0:
                continue
            if (shard, b) in self.refs:
                self.refs[(shard, b)] -= 1
                if self.refs[(shard, b)]:
                    continue
                del self.refs[(shard, b)]
                self.shared.pop(self._owner.pop((shard, b)), None)
            self.free[shard].append(b)

    def check(self, table: np.ndarray):
        """In every shard, every block but the null one is either free or held, by one row or, a shared prompt
        block, by as many rows as its count says: none leaked, none shared by mistake."""
        table = table.reshape(self.shards, -1, table.shape[1])
        for d, free in enumerate(self.free):
            held, count = np.unique(table[d][table[d] > 0], return_counts=True)
            both = np.concatenate([held, free.as_array().astype(held.dtype)])
            shared_ok = all(self.refs.get((d, int(b)), 1) == k for b, k in zip(held, count))
            if len(both) != self.blocks - 1 or set(both.tolist()) != set(range(1, self.blocks)) or not shared_ok:
                raise RuntimeError(f"paged KV bookkeeping broken in shard {d}: {len(held)} blocks held, "
                                   f"{len(free)} free, pool of {self.blocks - 1}, shared counts "
                                   f"{'ok' if shared_ok else 'wrong'}")
