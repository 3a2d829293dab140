"""Chunked prefill and what a prefill costs in memory.

A prompt of S slots runs through the cache in chunks of at most `chunk` tokens: each chunk writes its keys
and values at its slots and attends to everything before it (the cached part of the prompt) and to itself.
With dense attention a chunk's scores are [rows, heads, chunk, window], so prefill memory grows linearly in
the prompt (the window) instead of quadratically (one [rows, heads, S, S] pass).

The chunks run in a `lax.fori_loop` inside the jitted prefill program rather than as a host loop over a
chunk program: the prompt still compiles one program per shape bucket, as before chunking; the cache is the
loop's carry, updated in place, with no per-chunk dispatch or donation; and the model's graph appears once in
the program, so a chunked prefill compiles about as fast as an unchunked one.
"""
from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp

from marl_jax.generate.buckets import batch_bucket, length_bucket
from marl_jax.models.decoder import ModelConfig

PREFILL_CHUNK = 2048  # prompts up to this many slots run in one pass, as they did before chunking


def chunk_starts(S: int, chunk: int) -> list[int]:
    """First slot (within the S slots) of each chunk: every chunk is `chunk` long and the last one ends at
    S, so when chunk does not divide S the last chunk repeats the previous one's end (those tokens are
    computed again against the same cache and write the same keys and values)."""
    if chunk < 1:
        raise ValueError(f"prefill chunk must be >= 1, got {chunk}")
    if S <= chunk:
        return [0]
    n = -(-S // chunk)
    return [i * chunk for i in range(n - 1)] + [S - chunk]


def prefill_chunks(run: Callable, tokens: jax.Array, positions: jax.Array, valid: jax.Array, cache, start,
                   window: int, chunk: int):
    """Prefill tokens [B, S] (positions and valid [B, S]) into cache slots start..start+S-1 in chunks of
    `chunk` tokens. `run(tokens, positions, cache, write_index, valid, window=...)` is forward_cached with
    last_only=True; `window` covers every slot the prompt writes. Returns (logits [B, 1, V] of the last
    token, cache). A prompt of at most `chunk` slots is one call, the program an unchunked prefill runs."""
    starts = chunk_starts(tokens.shape[1], chunk)
    if len(starts) == 1:
        return run(tokens, positions, cache, jnp.int32(start), valid, window=window)
    step, last = starts[1], starts[-1]

    def one(s, cache):
        cut = lambda x: jax.lax.dynamic_slice_in_dim(x, s, chunk, axis=1)
        return run(cut(tokens), cut(positions), cache, jnp.int32(start) + s, cut(valid), window=window)

    def body(i, carry):  # carry: (logits, cache); the last chunk's logits are the ones that remain
        return one(jnp.minimum(i * step, last).astype(jnp.int32), carry[1])

    shape = jax.eval_shape(lambda c: one(jnp.int32(0), c)[0], cache)  # the logits carried between chunks
    return jax.lax.fori_loop(0, len(starts), body, (jnp.zeros(shape.shape, shape.dtype), cache))


# ---- memory: what a generate call needs, checked before anything is allocated ----

def generate_bytes(cfg: ModelConfig, prompt_lens, new_tokens: int, *, chunk: int = PREFILL_CHUNK,
                   distinct: int | None = None, min_batch: int = 1, dtype_bytes: int = 4,
                   weight_bytes: int | None = None) -> dict[str, int]:
    """Bytes one Sampler.generate call over prompts of these lengths holds at its peak, by part, with dense
    attention (an upper bound for memory-bounded attention):

    weights      the parameters (weight_bytes, or cfg.num_params() at dtype_bytes);
    kv_cache     the distinct prompts' prefill cache and the decode rows' copy of it, both live when the
                 rows are expanded: (distinct rows + rows) x (prompt + new-token slots);
    transient    the larger of one prefill chunk (a layer's float32 scores and their probabilities over the
                 prompt window, its window of keys and values, its activations) and one decode step (a
                 layer's window of the cache, the float32 logits and their softmax);
    total        their sum."""
    lens = list(prompt_lens)
    B = batch_bucket(len(lens), min_batch)
    Bu = batch_bucket(distinct or len(lens), 1)
    P, Tn = length_bucket(max(lens)), length_bucket(new_tokens)
    L, Hq, Hkv, hd = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    D, F, V, e = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, dtype_bytes
    slot = 2 * L * Hkv * hd * e + 1  # keys and values of every layer, and the valid flag
    kv = (Bu + B) * (P + Tn) * slot
    c = min(chunk, P)
    scores = Bu * Hq * c * P * (4 + e) + Bu * c * P  # scores, probabilities, mask
    window = 2 * Bu * Hkv * hd * P * e  # the layer's keys and values read back from the cache
    acts = Bu * c * (4 * D + 2 * cfg.q_dim + 2 * cfg.kv_dim + 3 * F) * 4
    prefill = scores + window + acts + Bu * V * 8
    decode = 2 * B * Hkv * hd * (P + Tn) * e + B * V * 8
    weights = cfg.num_params() * dtype_bytes if weight_bytes is None else int(weight_bytes)
    transient = max(prefill, decode)
    return dict(weights=int(weights), kv_cache=int(kv), transient=int(transient),
                total=int(weights + kv + transient))


def fitting_chunk(cfg: ModelConfig, prompt_lens, new_tokens: int, available: int, **kw) -> int:
    """The largest power-of-two prefill chunk (16 at least) whose generate_bytes fit in `available`; 0 if none."""
    c = 1 << max(max(prompt_lens) - 1, 1).bit_length()
    while c >= 16:
        if generate_bytes(cfg, prompt_lens, new_tokens, chunk=c, **kw)["total"] <= available:
            return c
        c //= 2
    return 0


def host_available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process could still take: the kernel's MemAvailable, or less when a cgroup limit (v2
    memory.max, v1 memory.limit_in_bytes) is nearer; None when neither can be read."""
    found = []
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                            "memory/memory.usage_in_bytes")):
        try:
            with open(os.path.join(cgroup, limit)) as f:
                lim = f.read().strip()
            with open(os.path.join(cgroup, usage)) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if lim.isdigit() and int(lim) < 1 << 60:
            found.append(max(int(lim) - used, 0))
    return min(found) if found else None


def available_bytes(device=None) -> int | None:
    """Free memory of the device generation runs on: the accelerator's limit minus what is in use, or on
    CPU the host's (host_available_bytes); None when unknown."""
    device = device or jax.devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory stats
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    return host_available_bytes()
