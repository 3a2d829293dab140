"""The prefix cache: keys and values of earlier calls' sequences (prompt + completion), kept on the device and
found again by their tokens, so that a later prompt extending one (an eval_opt round, a synthesizer's prompt
embedding its workers' transcripts, every episode of a task) loads them instead of prefilling them. The cache
empties when the parameters change."""
from __future__ import annotations

import collections
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from marl_jax.models import sharding
from marl_jax.models.decoder import PREFIX_AXES, ModelConfig


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

    def __init__(self, cfg: ModelConfig, num_blocks: int, block: int = 16, dtype=jnp.float32, mesh=None, rules=None):
        if num_blocks < 1 or block < 1:
            raise ValueError(f"prefix cache needs num_blocks >= 1 and block >= 1, got {num_blocks}, {block}")
        self.cfg, self.num_blocks, self.block, self.dtype = cfg, num_blocks, block, dtype
        self.mesh, self.rules = mesh, rules  # on a mesh: KV heads over "model", as the store program keeps them
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
            if self.mesh is not None:
                put = lambda x, names: jax.device_put(x, NamedSharding(
                    self.mesh, sharding.spec_for(names, x.shape, self.mesh, self.rules)))
                self.k, self.v = (put(x, n) for x, n in zip((self.k, self.v), PREFIX_AXES))
