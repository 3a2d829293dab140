"""One decoder-only transformer for Llama, Qwen2 and Qwen3 checkpoints, as Flax linen modules used purely.

Parameters are a plain pytree with the layers stacked on a leading axis so one `nn.scan` runs them:

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D], "wq": [L, D, Hq*hd], "wk": [L, D, Hkv*hd], "wv": [L, D, Hkv*hd],
                "wo": [L, Hq*hd, D], ("bq", "bk", "bv": [L, H*hd] when qkv_bias),
                ("q_norm", "k_norm": [L, hd] when qk_norm), "mlp_norm": [L, D],
                "w_gate": [L, D, F], "w_up": [L, D, F], "w_down": [L, F, D]},
     "final_norm": [D], ("lm_head": [D, V] unless tied)}

Matrices are stored [in, out] so a layer is `x @ w`. Family differences are flags on ModelConfig;
the code has no per-family branches beyond them.

Why linen and not NNX: a policy here is a function of parameters that the trainer owns, stacks per
slot, shards and donates; linen's `Decoder(cfg).apply({"params": base, "lora": {"layers": adapters}}, ...)`
takes exactly those plain pytrees, with no module state to split and merge on every call, and
`nn.scan` / `nn.remat` / `nn.with_logical_partitioning` give the stacked, scanned, logically named
layers MaxText uses. The variables are two collections: "params" (the frozen base, or one slot of full
trainable weights) and "lora" (one slot of adapters, {"layers": {name: {"a": [L, in, r], "b": [L, r, out]}}}).
The trainer keeps trainable trees with a leading slot axis and passes one slot in (see
marl_jax.policy.lora); the KV cache is an explicit argument and result.

Every parameter carries logical axis names (`param_axes`), and the main activations are constrained
with logical names when a mesh is given; marl_jax.models.sharding maps the names onto a
("data", "fsdp", "model") mesh with a rules table.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import attention as attn
from marl_jax.models.axes import (ACT_HEADS, ACT_HIDDEN, ACT_LOGITS, ACT_MLP, LAYER_AXES, LINEAR_NAMES,
                                  TOP_AXES)

Params = Mapping[str, Any]

@dataclasses.dataclass(frozen=True)
class ModelConfig:
    family: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    # How attention is computed (marl_jax.models.attention: auto | dense | blockwise | splash | cudnn);
    # not part of the checkpoint, every choice computes the same values.
    attention: str = "auto"

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        d, f, l = self.hidden_size, self.intermediate_size, self.num_layers
        per_layer = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + l * per_layer + d + head

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs for one token attending over `context` keys (matmuls only)."""
        d, f = self.hidden_size, self.intermediate_size
        linear = d * (self.q_dim + 2 * self.kv_dim) + self.q_dim * d + 3 * d * f
        attn = 2 * self.q_dim * context  # q.k and p.v
        return 2.0 * (self.num_layers * (linear + attn) + d * self.vocab_size)


_FAMILY_FLAGS = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """ModelConfig from a Hugging Face config.json dict (transformers 4.x or 5.x spelling)."""
    family = hf.get("model_type")
    if family not in _FAMILY_FLAGS:
        raise ValueError(
            f"unsupported model_type {family!r}; marl_jax supports {sorted(_FAMILY_FLAGS)} "
            "(add a family flag set in marl_jax/models/decoder.py to support another)")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope scaling {rope_type!r} is not supported yet; only plain RoPE")
    theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    flags = dict(_FAMILY_FLAGS[family])
    # Settings transformers honours that this decoder does not implement: refuse them rather than load
    # a model that silently computes something else.
    if hf.get("attention_bias") and family in ("llama", "qwen3"):
        raise ValueError("attention_bias=True checkpoints (biases on q/k/v and o_proj) are not supported")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=True checkpoints are not supported")
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act={act!r} is not supported; the MLP is SwiGLU (hidden_act='silu')")
    layer_types = hf.get("layer_types") or []
    window_layers = (range(hf.get("max_window_layers") or 0, hf["num_hidden_layers"])
                     if hf.get("use_sliding_window") else ())
    if any(t != "full_attention" for t in layer_types) or (
            not layer_types and hf.get("sliding_window") and len(window_layers)):
        raise ValueError(f"sliding-window attention (use_sliding_window / sliding_window={hf.get('sliding_window')}, "
                         "layer_types) is not supported; only full attention")
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(hf["eos_token_id"]) if isinstance(hf.get("eos_token_id"), list)
        else hf.get("eos_token_id"),
        **flags,
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    """The config.json dict transformers needs to rebuild this model."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    out = {
        "architectures": [arch[cfg.family]],
        "model_type": cfg.family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if cfg.family == "llama":
        if cfg.qkv_bias:  # HF's attention_bias also adds an o_proj bias this decoder does not have
            raise ValueError("a llama config with qkv_bias has no Hugging Face equivalent; use family='qwen2'")
        out["attention_bias"] = False
        out["mlp_bias"] = False
    if cfg.bos_token_id is not None:
        out["bos_token_id"] = cfg.bos_token_id
    if cfg.eos_token_id is not None:
        out["eos_token_id"] = list(cfg.eos_token_id) if isinstance(cfg.eos_token_id, tuple) else cfg.eos_token_id
    return out


def _normal(key, shape, dtype=jnp.float32):
    return (0.02 * jax.random.normal(key, shape)).astype(dtype)  # HF's initializer_range


class KVCache(NamedTuple):
    """Keys and values of every layer: k [L, B, Hkv, hd, T] (keys stored transposed) and v
    [L, B, Hkv, T, hd]. Slot j of row b holds token j of its (left-padded) sequence; `valid` [B, T]
    marks slots that hold a real token.

    The layout is the one attention's two matmuls read: q.k over [hd, T] and p.v over [T, hd]. With
    the [B, T, Hkv, hd] layout XLA transposed each layer's cache on every decode step, about 30% of a
    CPU decode step at batch 64."""

    k: jax.Array
    v: jax.Array
    valid: jax.Array

    def map_batch(self, fn) -> "KVCache":
        """Apply fn(x, axis) to every buffer along its batch axis (row gathers, compaction)."""
        return KVCache(fn(self.k, 1), fn(self.v, 1), fn(self.valid, 0))


KV_AXES = KVCache(("layers", "batch", "act_kv_heads", None, None), ("layers", "batch", "act_kv_heads", None, None),
                  ("batch", None))
KVCache.AXES = KV_AXES  # read by marl_jax.models.sharding.constrain_state


class PagedCache(NamedTuple):
    """A paged KV cache: keys and values live in a pool of blocks of `blk` slots, one pool part per row
    shard (k, v [Hkv, L, D, N, blk, hd]: KV heads first, then layers, D the devices rows are split over, 1
    without a mesh, N blocks each). Row b belongs to shard b // (B / D), and its slot j is slot j % blk of that
    shard's block table[b, j // blk] ([B, M], so a row addresses M * blk slots). Rows hold blocks only where
    they have tokens: memory follows the live tokens, not rows x maximum length, and each device keeps its own
    rows' blocks. Block 0 of each shard is its null block: unallocated table entries point there, and rows
    with nothing to write scribble on it.

    A row's token at position p sits in its slot p, so its valid slots are a prefix: [0, pos) before a
    decode step writes slot pos (DecodeState.pos). No per-slot flag is kept; attention takes lengths.

    Why this layout: it reshapes for free (a bitcast) to the pages jax's Pallas paged-attention kernel reads,
    [Hkv, L * D * N, blk, hd] (a layer's pages offset by layer * D * N), so TPU decode hands the kernel the
    whole stacked pool and nothing is sliced or copied per layer; the new keys and values are scattered into
    it in place.

    free [D, N] / top [D]: shard d's free blocks are free[d, :top[d]] (a stack the decode loop pops from
    as rows grow)."""

    k: jax.Array
    v: jax.Array
    table: jax.Array
    free: jax.Array
    top: jax.Array

    @property
    def block(self) -> int:
        return self.k.shape[4]

    @property
    def shards(self) -> int:
        return self.k.shape[2]

    @property
    def blocks(self) -> int:
        return self.k.shape[3]

    @property
    def length(self) -> int:
        """Slots a row addresses."""
        return self.table.shape[1] * self.block

    def map_batch(self, fn) -> "PagedCache":
        """Rows move by their block tables; the pool stays where it is (callers keep rows in their shard)."""
        return self._replace(table=fn(self.table, 0))


_POOL_AXES = ("act_kv_heads", "layers", "batch", None, None, None)
PAGED_AXES = PagedCache(_POOL_AXES, _POOL_AXES, ("batch", None), ("batch", None), ("batch",))
PagedCache.AXES = PAGED_AXES
# The sampler's prefix cache: keys [L, Hkv, hd, n] and values [L, Hkv, n, hd], KV heads over "model".
PREFIX_AXES = (("layers", "act_kv_heads", None, None), ("layers", "act_kv_heads", None, None))


def init_paged(cfg: ModelConfig, blocks: int, block: int, batch: int, length: int, shards: int = 1,
               dtype=jnp.float32) -> PagedCache:
    """An empty pool of `blocks` blocks per shard (block 0 the null block) for `batch` rows of `length` slots."""
    if length % block:
        raise ValueError(f"paged cache length {length} is not a multiple of the block size {block}")
    if batch % shards:
        raise ValueError(f"paged cache rows ({batch}) must split evenly over {shards} shards")
    free = np.zeros((shards, blocks), np.int32)
    free[:, :blocks - 1] = np.arange(blocks - 1, 0, -1)  # popped from the top: 1, 2, ... first
    shape = (cfg.num_kv_heads, cfg.num_layers, shards, blocks, block, cfg.head_dim)
    return PagedCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((batch, length // block), jnp.int32),
                      jnp.asarray(free), jnp.full((shards,), blocks - 1, jnp.int32))


def paged_write(pool: jax.Array, layer, blocks: jax.Array, offsets: jax.Array, values: jax.Array) -> jax.Array:
    """pool [Hkv, L, D, N, blk, hd] with values [B, S, Hkv, hd] written at layer `layer`, each row's shard's
    blocks [B, S] and offsets [B, S]: one scatter into the stacked pool, in place (no layer is sliced out).
    Over several shards a vmap over the shard axis, so the scatter is partitioned shard by shard."""
    D = pool.shape[2]
    x = values.transpose(2, 0, 1, 3).astype(pool.dtype)  # [Hkv, B, S, hd]
    # Every axis but hd indexed (the head too, not sliced): XLA:TPU scatters rows of hd in place; with the
    # head axis sliced (a window of [Hkv, hd]) it copied the whole pool at every layer.
    h = jnp.arange(pool.shape[0])[:, None, None]
    if D == 1:  # XLA:CPU runs the plain scatter faster than one with a batch dimension
        return pool.at[h, layer, 0, blocks[None], offsets[None]].set(x)
    split = lambda a, axis=0: a.reshape(a.shape[:axis] + (D, a.shape[axis] // D) + a.shape[axis + 1:])
    return jax.vmap(lambda p, b, o, v: p.at[h, layer, b[None], o[None]].set(v), in_axes=(2, 0, 0, 1),
                    out_axes=2)(pool, split(blocks), split(offsets), split(x, 1))


def paged_read(pool: jax.Array, layer, blocks: jax.Array) -> jax.Array:
    """Each row's blocks [B, nb] of layer `layer` from its shard's pool: [B, nb * blk, Hkv, hd]."""
    Hkv, _, D, _, blk, hd = pool.shape
    B = blocks.shape[0]
    if D == 1:
        x = pool[:, layer, 0, blocks]  # [Hkv, B, nb, blk, hd]
    else:
        x = jax.vmap(lambda p, b: p[:, layer, b], in_axes=(2, 0), out_axes=1)(pool, blocks.reshape(D, B // D, -1))
        x = x.reshape((Hkv, B) + x.shape[3:])
    return x.transpose(1, 2, 3, 0, 4).reshape(B, -1, Hkv, hd)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=jnp.float32) -> KVCache:
    L, H, d = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    return KVCache(jnp.zeros((L, batch, H, d, length), dtype), jnp.zeros((L, batch, H, length, d), dtype),
                   jnp.zeros((batch, length), bool))


def _acc(dtype):
    """Accumulation dtype: float32, or float64 when computing in float64 (parity checks under x64)."""
    return jnp.promote_types(dtype, jnp.float32)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    # Normalise in float32 (float64 for float64 inputs), then scale in the compute dtype, as transformers does.
    xf = x.astype(_acc(x.dtype))
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * y.astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, HF "rotate_half" layout. x: [B, S, H, hd], positions: [B, S]."""
    hd = x.shape[-1]
    acc = _acc(x.dtype)
    # Angles and their cos/sin in float32 whatever the compute dtype, as transformers computes them.
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, hd/2]
    cos, sin = jnp.cos(ang)[:, :, None, :].astype(acc), jnp.sin(ang)[:, :, None, :].astype(acc)
    xf = x.astype(acc)
    x1, x2 = xf[..., : hd // 2], xf[..., hd // 2:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


REMAT = ("none", "dots", "full")
# "dots" also keeps blockwise attention's output and log-sum-exp (linear in T): recomputing them would rerun
# the whole forward loop inside the backward.
_REMAT_POLICY = {"dots": jax.checkpoint_policies.save_from_both_policies(
                     jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                     jax.checkpoint_policies.save_only_these_names(*attn.SAVED_NAMES)),
                 "full": jax.checkpoint_policies.nothing_saveable}


class _Sharded(nn.Module):
    """Activation constraints by logical name; a no-op without a mesh (one device, or inside a caller
    that places arrays itself)."""

    mesh: Any = None
    rules: tuple = ()

    def constrain(self, x, names):
        if self.mesh is None:
            return x
        from marl_jax.models import sharding
        return sharding.constrain(x, names, self.mesh, self.rules or None)


class Block(_Sharded):
    """One transformer block, scanned over the layer axis. `cached` picks the carry: the hidden state
    (teacher-forced) or (hidden, k cache, v cache, layer index) (prefill / decode over a KV cache)."""

    cfg: ModelConfig = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora_scale: float = 1.0
    cached: bool = False
    window: int = 0  # cached: cache slots attended ([0, window))
    paged: bool = False  # cached: the cache is a PagedCache pool (write_index is then (slots, table))

    def _param(self, name, shape, init=_normal):
        return self.param(name, nn.with_logical_partitioning(init, LAYER_AXES[name]), shape, self.param_dtype)

    def _linear(self, x, name, w):
        y = x @ w.astype(x.dtype)
        if self.has_variable("lora", name):
            ab = self.get_variable("lora", name)
            # 2-D [tokens, in] operands: XLA:CPU runs the adapter's weight-gradient matmuls about 2x
            # faster than with the batch axes left in.
            x2 = x.reshape(-1, x.shape[-1])
            d = ((x2 @ ab["a"].astype(x.dtype)) @ ab["b"].astype(x.dtype)) * self.lora_scale
            y = y + d.reshape(y.shape)
        return y

    @nn.compact
    def __call__(self, carry, positions, layout, write_index):
        cfg = self.cfg
        D, F, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
        x = carry[0] if self.cached else carry
        B, S, _ = x.shape
        ones = nn.initializers.ones
        h = rms_norm(x, self._param("attn_norm", (D,), ones), cfg.rms_norm_eps)
        q = self._linear(h, "wq", self._param("wq", (D, cfg.q_dim)))
        k = self._linear(h, "wk", self._param("wk", (D, cfg.kv_dim)))
        v = self._linear(h, "wv", self._param("wv", (D, cfg.kv_dim)))
        if cfg.qkv_bias:
            q = q + self._param("bq", (cfg.q_dim,)).astype(q.dtype)
            k = k + self._param("bk", (cfg.kv_dim,)).astype(k.dtype)
            v = v + self._param("bv", (cfg.kv_dim,)).astype(v.dtype)
        q = self.constrain(q, ACT_HEADS).reshape(B, S, cfg.num_heads, hd)
        k = k.reshape(B, S, cfg.num_kv_heads, hd)
        v = v.reshape(B, S, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q = rms_norm(q, self._param("q_norm", (hd,), ones), cfg.rms_norm_eps)
            k = rms_norm(k, self._param("k_norm", (hd,), ones), cfg.rms_norm_eps)
        q = rope(q, positions, cfg.rope_theta)
        k = rope(k, positions, cfg.rope_theta)
        if self.cached and self.paged:
            # Paged: this step's keys and values scattered into the rows' blocks of the stacked pool (in
            # place), then attention over each row's first W slots through its block table.
            _, k_pool, v_pool, i = carry
            widx, table = write_index
            W, blk = self.window, k_pool.shape[4]
            slots = widx[:, None] + jnp.arange(S)  # [B, S]
            blocks = jnp.take_along_axis(table, slots // blk, axis=1)
            k_pool = paged_write(k_pool, i, blocks, slots % blk, k)
            v_pool = paged_write(v_pool, i, blocks, slots % blk, v)
            read = table[:, :W // blk]
            how = attn.choose(cfg.attention, S, W, layout=layout, dtype=k_pool.dtype, pool=True)
            if how == "paged":  # TPU decode: the Pallas kernel reads the rows' pages of the whole pool in place
                a = attn.paged_decode(q, k_pool, v_pool, i, read, widx + S, mesh=self.mesh)
            elif how == "paged_fused":  # GPU decode: reductions over the rows' pages indexed in place
                a = attn.paged_fused(q, k_pool, v_pool, i, read, widx + S)
            else:  # gather the rows' blocks, then attend as over a dense cache
                a = attn.attention(q, paged_read(k_pool, i, read).astype(q.dtype),
                                   paged_read(v_pool, i, read).astype(q.dtype), layout, cfg.attention, mesh=self.mesh)
            k_cache, v_cache = k_pool, v_pool
        elif self.cached:
            _, k_cache, v_cache, i = carry
            H, W = cfg.num_kv_heads, self.window
            kn, vn = k.transpose(0, 2, 3, 1).astype(k_cache.dtype), v.transpose(0, 2, 1, 3).astype(v_cache.dtype)
            if jnp.ndim(write_index) == 1:  # each row writes at its own slot (continuous batching)
                rows, slots = jnp.arange(B)[:, None], write_index[:, None] + jnp.arange(S)  # [B, S]
                k_cache = k_cache.at[i, rows, :, :, slots].set(kn.transpose(0, 3, 1, 2))  # [B, S, H, hd]
                v_cache = v_cache.at[i, rows, :, slots, :].set(vn.transpose(0, 2, 1, 3))
            else:
                k_cache = jax.lax.dynamic_update_slice(k_cache, kn[None], (i, 0, 0, 0, write_index))
                v_cache = jax.lax.dynamic_update_slice(v_cache, vn[None], (i, 0, 0, write_index, 0))
            k_all = jax.lax.dynamic_slice(k_cache, (i, 0, 0, 0, 0), (1, B, H, hd, W))[0].astype(q.dtype)
            v_all = jax.lax.dynamic_slice(v_cache, (i, 0, 0, 0, 0), (1, B, H, W, hd))[0].astype(q.dtype)
            a = attn.attention(q, k_all, v_all, layout, cfg.attention, kv_layout="cache", mesh=self.mesh)
        else:
            a = attn.attention(q, k, v, layout, cfg.attention, mesh=self.mesh)
        x = x + self._linear(a, "wo", self._param("wo", (cfg.q_dim, D)))
        x = self.constrain(x, ACT_HIDDEN)
        h = rms_norm(x, self._param("mlp_norm", (D,), ones), cfg.rms_norm_eps)
        g = self._linear(h, "w_gate", self._param("w_gate", (D, F)))
        u = self._linear(h, "w_up", self._param("w_up", (D, F)))
        m = self.constrain(jax.nn.silu(g) * u, ACT_MLP)
        x = self.constrain(x + self._linear(m, "w_down", self._param("w_down", (F, D))), ACT_HIDDEN)
        if self.cached:
            return (x, k_cache, v_cache, i + 1), None
        return x, None


class Decoder(_Sharded):
    """The whole model. Methods (all pure; call through `apply`):

    __call__(tokens, valid)  teacher-forced logits [B, T, V] (training, scoring, parity);
    hidden(tokens, valid)    the final hidden states instead of logits;
    unembed(x)               final norm and LM head on hidden states;
    cached(...)              prefill / decode against a KVCache (see forward_cached).

    remat (what a backward pass keeps per layer): "none" keeps every activation (its [B, H, T, T]
    attention probabilities dominate memory); "dots" keeps the weight matmuls' outputs and blockwise
    attention's output and log-sum-exp, and recomputes dense attention; "full" keeps only the layer's
    input and recomputes the layer.

    unroll: the teacher-forced pass runs its layers as straight-line code instead of a loop. A loop's
    backward pass keeps each layer's activations in stacked [layers, ...] buffers, copied in and out per
    layer; unrolled, they stay where they were made (2.5% of a LoRA update step on 2 CPU cores), at about
    twice the compile time. Values are the same.
    """

    cfg: ModelConfig = None
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    lora_scale: float = 1.0
    remat: str = "none"
    unroll: bool = False

    def _top(self, name, shape, init=_normal):
        return self.param(name, nn.with_logical_partitioning(init, TOP_AXES[name]), shape, self.param_dtype)

    def _layers(self, carry, positions, layout, write_index=None, window: int = 0, paged: bool = False):
        cached = window > 0
        if self.remat not in REMAT:
            raise ValueError(f"remat must be one of {REMAT}, got {self.remat!r}")
        block = Block
        if self.remat != "none" and not cached:
            block = nn.remat(Block, policy=_REMAT_POLICY[self.remat], prevent_cse=False)
        scanned = nn.scan(block, variable_axes={"params": 0, "lora": 0}, split_rngs={"params": True},
                          in_axes=(nn.broadcast, nn.broadcast, nn.broadcast), length=self.cfg.num_layers,
                          unroll=self.cfg.num_layers if self.unroll and not cached else 1,
                          metadata_params={nn.PARTITION_NAME: "layers"})
        return scanned(cfg=self.cfg, dtype=self.dtype, param_dtype=self.param_dtype, lora_scale=self.lora_scale,
                       cached=cached, window=window, paged=paged, mesh=self.mesh, rules=self.rules,
                       name="layers")(carry, positions, layout, write_index)[0]

    @nn.compact
    def _run(self, tokens=None, valid=None, hidden=None, *, logits=True, cache=None, positions=None,
             write_index=None, new_valid=None, last_only=False, window=None, segments=None, right_padded=False):
        cfg = self.cfg
        embed = self._top("embed", (cfg.vocab_size, cfg.hidden_size))
        final_norm = self._top("final_norm", (cfg.hidden_size,), nn.initializers.ones)
        head = None if cfg.tie_word_embeddings else self._top("lm_head", (cfg.hidden_size, cfg.vocab_size))
        new_cache = None
        if tokens is not None:
            # The table's model dimension gathered first (as FSDP gathers every weight before use): a lookup
            # straight from an fsdp-split table leaves XLA no cheap way to rows split over data x fsdp.
            table = self.constrain(embed, ("act_vocab", "act_embed"))
            x = self.constrain(jnp.take(table, tokens, axis=0).astype(self.dtype), ACT_HIDDEN)
            if cache is None and segments is not None:
                positions, layout = (shared_prefix_layout(*segments) if isinstance(segments, tuple)
                                     else segment_layout(segments))
                hidden = self._layers(x, positions, layout)
            elif cache is None:
                B, T = tokens.shape
                if valid is None:
                    valid = jnp.ones((B, T), bool)
                positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
                hidden = self._layers(x, positions, attn.causal(valid, right_padded))
            else:
                paged = isinstance(cache, PagedCache)
                S, T = tokens.shape[1], (cache.length if paged else cache.valid.shape[1])
                W = T if window is None else window
                if not 0 < W <= T:
                    raise ValueError(f"window must be in (0, {T}], got {window}")
                if paged:
                    if W % cache.block or jnp.ndim(write_index) != 1:
                        raise ValueError(f"a paged cache needs a window that is a multiple of its block "
                                         f"({cache.block}, got {W}) and a write slot per row")
                    # Rows are compacted (token p in slot p): after this write a row's valid slots are
                    # [0, write_index + S), a prefix; lengths, not flags.
                    query_slot = write_index[:, None] + jnp.arange(S)
                    layout = attn.cached(query_slot, jnp.arange(W)[None] < (write_index + S)[:, None], True)
                    hidden, k, v, _ = self._layers((x, cache.k, cache.v, jnp.int32(0)), positions, layout,
                                                   (write_index, cache.table), W, True)
                    new_cache = cache._replace(k=k, v=v)
                else:
                    t = jnp.arange(T)[None]
                    if jnp.ndim(write_index) == 1:  # a write slot per row
                        # An elementwise select, not a per-row dynamic_update_slice (a vmap of it compiles
                        # to a serial loop over rows, each copying the whole mask).
                        w = write_index[:, None]
                        hit = (t >= w) & (t < w + S)
                        new = jnp.take_along_axis(new_valid, jnp.clip(t - w, 0, S - 1), axis=1)
                        cvalid = jnp.where(hit, new, cache.valid)
                        query_slot = w + jnp.arange(S)  # [B, S]
                    else:
                        cvalid = jax.lax.dynamic_update_slice(cache.valid, new_valid, (0, write_index))
                        query_slot = jnp.broadcast_to(write_index + jnp.arange(S), (tokens.shape[0], S))
                    layout = attn.cached(query_slot, cvalid[:, :W], right_padded)
                    hidden, k, v, _ = self._layers((x, cache.k, cache.v, jnp.int32(0)), positions, layout,
                                                   write_index, W, False)
                    new_cache = KVCache(k, v, cvalid)
                if last_only:
                    hidden = hidden[:, -1:]
        if not logits:
            return hidden
        # Final norm and LM head; logits in float32 (float64 when computing in float64).
        x = rms_norm(hidden, final_norm, cfg.rms_norm_eps)
        w = embed.T if head is None else head
        out = self.constrain(jnp.matmul(x, w.astype(x.dtype), preferred_element_type=_acc(x.dtype)), ACT_LOGITS)
        return out if new_cache is None else (out, new_cache)

    def __call__(self, tokens, valid=None, segments=None, right_padded=False):
        return self._run(tokens, valid, segments=segments, right_padded=right_padded)

    def hidden(self, tokens, valid=None, segments=None, right_padded=False):
        return self._run(tokens, valid, logits=False, segments=segments, right_padded=right_padded)

    def unembed(self, x):
        return self._run(hidden=x)

    def cached(self, tokens, positions, cache, write_index, new_valid, last_only=False, window=None,
               right_padded=False):
        return self._run(tokens, cache=cache, positions=positions, write_index=write_index, new_valid=new_valid,
                         last_only=last_only, window=window, right_padded=right_padded)


# ---- pure-function entry points: one Decoder, variables passed in ----

def variables(params: Params, lora: Params | None = None) -> dict:
    """The linen variables of one policy: base (or full) params, and one slot's adapters if any."""
    out = {"params": params}
    if lora is not None:
        out["lora"] = {"layers": lora}
    return out


def _module(cfg, dtype=jnp.float32, lora_scale=1.0, remat="none", mesh=None, rules=(), unroll=False):
    return Decoder(cfg=cfg, dtype=dtype, lora_scale=lora_scale, remat=remat, mesh=mesh, rules=tuple(rules or ()),
                   unroll=unroll)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, valid: jax.Array | None = None, *,
            lora: Params | None = None, lora_scale: float = 1.0, dtype=jnp.float32,
            return_hidden: bool = False, remat: str = "none", mesh=None, rules=(),
            segments: jax.Array | None = None, unroll: bool = False, right_padded: bool = False) -> jax.Array:
    """Teacher-forced forward pass over full sequences (training, scoring, parity).

    tokens [B, T]; valid [B, T] marks real tokens (left or right padding both work: positions count
    real tokens only, and padding is masked out of attention). Returns float32 logits [B, T, V], or
    the final hidden states with return_hidden. See Decoder for remat and unroll.

    segments [B, T] int (instead of valid): packed sequences, several rows laid end to end in one
    sequence; each row's tokens carry one id > 0 and padding 0. Positions restart at 0 in every
    segment and attention stays within a segment (see segment_layout), so each row's outputs are
    those of the row run alone. A tuple (segments, parents, positions) lays rows that share a prefix
    over one copy of it (see shared_prefix_layout).

    right_padded: the caller promises each row's valid tokens are a prefix of it (what cuDNN's fused
    attention can express on GPU; marl_jax.models.attention).
    """
    m = _module(cfg, dtype, lora_scale, remat, mesh, rules, unroll)
    return m.apply(variables(params, lora), tokens, valid, segments, right_padded,
                   method=Decoder.hidden if return_hidden else Decoder.__call__)


def segment_layout(segments: jax.Array) -> tuple[jax.Array, attn.Layout]:
    """Positions [B, T] and attention layout of packed sequences: a token attends to the earlier tokens of
    its own segment only (never across rows, never to padding, id 0), and its position counts from its
    segment's first token. Segments are contiguous runs of one id."""
    B, T = segments.shape
    idx = jnp.arange(T)
    starts = jnp.concatenate([jnp.ones((B, 1), bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(starts, idx[None], 0), axis=1)
    return idx[None] - first, attn.packed(segments)


def shared_prefix_layout(segments: jax.Array, parents: jax.Array, positions: jax.Array
                         ) -> tuple[jax.Array, attn.Layout]:
    """Positions and attention layout of packed sequences where rows share prefixes: a token attends to the
    earlier tokens of its own segment and of its parent segment (a prefix laid once before the rows that
    extend it; parent 0: none), never to padding (id 0). positions [B, T] are given (a row's tokens after
    a shared prefix continue its count), so each row's outputs are those of the row run alone."""
    return positions, attn.shared_prefix(segments, parents)


def unembed(params: Params, cfg: ModelConfig, x: jax.Array, *, mesh=None, rules=()) -> jax.Array:
    """Final norm and LM head; logits in float32 (float64 when computing in float64)."""
    return _module(cfg, x.dtype, mesh=mesh, rules=rules).apply(variables(params), x, method=Decoder.unembed)


def forward_cached(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   cache: KVCache, write_index: jax.Array, new_valid: jax.Array, *,
                   lora: Params | None = None, lora_scale: float = 1.0, dtype=jnp.float32,
                   last_only: bool = False, window: int | None = None, mesh=None, rules=(),
                   right_padded: bool = False):
    """Run `tokens` [B, S] (written at cache slots write_index..write_index+S-1, the same slots for
    every row; a write_index of shape [B] gives each row its own start slot) against the cache. Returns
    (logits [B, S, V] float32, updated cache).

    Used for prefill (S = padded prompt length, write_index = 0) and decode (S = 1). `last_only`
    computes logits for the last position only (prefill needs no others; the LM head is costly).
    `window` (static) attends over cache slots [0, window) only, which the caller guarantees hold
    every slot written so far (write_index + S <= window): early decode steps then do not pay for
    the empty end of the cache.

    `cache` may be a PagedCache (decode only: one write slot per row, a window that is a multiple of the
    block); rows then write and read their slots through their block tables.

    right_padded: the caller promises each row's valid cache slots (after this write) are a prefix of its
    slots, no holes. Decode over a PagedCache then runs jax's Pallas paged-attention kernel on TPU
    (marl_jax.models.attention.paged_decode); without the promise, or elsewhere, the rows' blocks are
    gathered and attended as over a dense cache.
    """
    m = _module(cfg, dtype, lora_scale, "none", mesh, rules)
    return m.apply(variables(params, lora), tokens, positions, cache, write_index, new_valid, last_only, window,
                   right_padded, method=Decoder.cached)


def _abstract(cfg: ModelConfig, dtype=jnp.float32):
    m = Decoder(cfg=cfg, param_dtype=dtype)
    return jax.eval_shape(m.init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters (tests and benchmarks): N(0, 0.02) matrices, unit norms, like HF's initializer."""
    boxed = Decoder(cfg=cfg, param_dtype=dtype).init(key, jnp.zeros((1, 1), jnp.int32))
    return nn.meta.unbox(boxed)["params"]


def param_axes(cfg: ModelConfig) -> dict:
    """Logical axis names of every parameter, as a tree of tuples shaped like the params (the
    module's own annotations, read from an abstract init: no memory is allocated)."""
    specs = nn.get_partition_spec(_abstract(cfg))["params"]
    return jax.tree_util.tree_map(lambda s: tuple(s), specs, is_leaf=lambda s: isinstance(s, jax.sharding.PartitionSpec))


def lora_axes(cfg: ModelConfig, names) -> dict:
    """Logical axes of one slot's adapters: a [L, in, r] and b [L, r, out] take the base matrix's in / out names."""
    layer = param_axes(cfg)["layers"]
    return {n: {"a": (layer[n][0], layer[n][1], "lora_rank"), "b": (layer[n][0], "lora_rank", layer[n][2])}
            for n in names}


def cast_params(params: Params, dtype) -> Params:
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
