"""One decoder-only transformer for Llama, Qwen2 and Qwen3 checkpoints, as pure functions.

Parameters are a plain pytree with the layers stacked on a leading axis so one `lax.scan` runs them:

    {"embed": [V, D],
     "layers": {"attn_norm": [L, D], "wq": [L, D, Hq*hd], "wk": [L, D, Hkv*hd], "wv": [L, D, Hkv*hd],
                "wo": [L, Hq*hd, D], ("bq", "bk", "bv": [L, H*hd] when qkv_bias),
                ("q_norm", "k_norm": [L, hd] when qk_norm), "mlp_norm": [L, D],
                "w_gate": [L, D, F], "w_up": [L, D, F], "w_down": [L, F, D]},
     "final_norm": [D], ("lm_head": [D, V] unless tied)}

Matrices are stored [in, out] so a layer is `x @ w`. Family differences are flags on ModelConfig;
the code has no per-family branches beyond them.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Params = Mapping[str, Any]

LINEAR_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


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


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32) -> dict:
    """Random parameters (for tests and benchmarks), std 0.02 like HF's initializer."""
    L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    ks = iter(jax.random.split(key, 16))

    def normal(shape):
        return (0.02 * jax.random.normal(next(ks), shape)).astype(dtype)

    layers = {
        "attn_norm": jnp.ones((L, D), dtype),
        "wq": normal((L, D, cfg.q_dim)),
        "wk": normal((L, D, cfg.kv_dim)),
        "wv": normal((L, D, cfg.kv_dim)),
        "wo": normal((L, cfg.q_dim, D)),
        "mlp_norm": jnp.ones((L, D), dtype),
        "w_gate": normal((L, D, F)),
        "w_up": normal((L, D, F)),
        "w_down": normal((L, F, D)),
    }
    if cfg.qkv_bias:
        layers.update(bq=normal((L, cfg.q_dim)), bk=normal((L, cfg.kv_dim)), bv=normal((L, cfg.kv_dim)))
    if cfg.qk_norm:
        layers.update(q_norm=jnp.ones((L, cfg.head_dim), dtype), k_norm=jnp.ones((L, cfg.head_dim), dtype))
    params = {"embed": normal((cfg.vocab_size, D)), "layers": layers, "final_norm": jnp.ones((D,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = normal((D, cfg.vocab_size))
    return params


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


def linear(x: jax.Array, w: jax.Array, lora: Mapping[str, jax.Array] | None, lora_scale: float) -> jax.Array:
    y = x @ w.astype(x.dtype)
    if lora is not None:
        # 2-D [tokens, in] operands: XLA:CPU runs the adapter's weight-gradient matmuls about 2x faster
        # than with the batch axes left in.
        x2 = x.reshape(-1, x.shape[-1])
        d = ((x2 @ lora["a"].astype(x.dtype)) @ lora["b"].astype(x.dtype)) * lora_scale
        y = y + d.reshape(y.shape)
    return y


def attention(q, k, v, mask):
    """Grouped-query attention. q [B,S,Hq,hd]; k, v [B,T,Hkv,hd]; mask [B,S,T] bool."""
    B, S, Hq, hd = q.shape
    Hkv = k.shape[2]
    q = q.reshape(B, S, Hkv, Hq // Hkv, hd)
    scores = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=_acc(q.dtype)) / math.sqrt(hd)
    scores = jnp.where(mask[:, None, None], scores, -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgst,btkd->bskgd", probs, v)
    return out.reshape(B, S, Hq * hd)


def _layer(cfg: ModelConfig, x, lp, lora, lora_scale, positions, attn_fn):
    """One transformer block. attn_fn(q, k_new, v_new) -> (attention output [B, S, Hq*hd], carry) hides
    masking and cache handling."""
    B, S, _ = x.shape
    lo = (lambda name: None) if lora is None else (lambda name: lora.get(name))
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = linear(h, lp["wq"], lo("wq"), lora_scale)
    k = linear(h, lp["wk"], lo("wk"), lora_scale)
    v = linear(h, lp["wv"], lo("wv"), lora_scale)
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"].astype(q.dtype), k + lp["bk"].astype(k.dtype), v + lp["bv"].astype(v.dtype)
    q = q.reshape(B, S, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
        k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q = rope(q, positions, cfg.rope_theta)
    k = rope(k, positions, cfg.rope_theta)
    a, carry = attn_fn(q, k, v)
    x = x + linear(a, lp["wo"], lo("wo"), lora_scale)
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    g = linear(h, lp["w_gate"], lo("w_gate"), lora_scale)
    u = linear(h, lp["w_up"], lo("w_up"), lora_scale)
    x = x + linear(jax.nn.silu(g) * u, lp["w_down"], lo("w_down"), lora_scale)
    return x, carry


def embed(params: Params, tokens: jax.Array, dtype) -> jax.Array:
    return jnp.take(params["embed"], tokens, axis=0).astype(dtype)


def unembed(params: Params, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """Final norm and LM head; logits in float32 (float64 when computing in float64)."""
    x = rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=_acc(x.dtype))


REMAT = ("none", "dots", "full")


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, valid: jax.Array | None = None, *,
            lora: Params | None = None, lora_scale: float = 1.0, dtype=jnp.float32,
            return_hidden: bool = False, remat: str = "none") -> jax.Array:
    """Teacher-forced forward pass over full sequences (training, scoring, parity).

    tokens [B, T]; valid [B, T] marks real tokens (left or right padding both work: positions count
    real tokens only, and padding is masked out of attention). Returns float32 logits [B, T, V].
    remat (what a backward pass keeps per layer): "none" keeps every activation (its [B, H, T, T]
    attention probabilities dominate memory); "dots" keeps the weight matmuls' outputs and recomputes
    the attention; "full" keeps only the layer's input and recomputes the layer (about one more
    forward pass; memory per token per layer is one hidden vector).
    """
    B, T = tokens.shape
    if valid is None:
        valid = jnp.ones((B, T), bool)
    positions = jnp.maximum(jnp.cumsum(valid, axis=1) - 1, 0)
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = causal[None] & valid[:, None, :]

    def attn_fn(q, k, v):
        return attention(q, k, v, mask), None

    def body(x, xs):
        lp, lo = xs
        x, _ = _layer(cfg, x, lp, lo, lora_scale, positions, attn_fn)
        return x, None

    if remat not in REMAT:
        raise ValueError(f"remat must be one of {REMAT}, got {remat!r}")
    if remat == "dots":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    elif remat == "full":
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    x = embed(params, tokens, dtype)
    x, _ = jax.lax.scan(body, x, (params["layers"], lora))
    return x if return_hidden else unembed(params, cfg, x)


def cached_attention(q, k_cache, v_cache, mask):
    """Attention of q [B, S, Hq, hd] over one layer's cache (k [B, Hkv, hd, T], v [B, Hkv, T, hd]);
    mask [B, S, T]. Both products are plain batched matmuls over the cache as it is laid out."""
    B, S, Hq, hd = q.shape
    Hkv, T = k_cache.shape[1], k_cache.shape[3]
    g = Hq // Hkv
    qg = q.reshape(B, S, Hkv, g, hd).transpose(0, 2, 3, 1, 4).reshape(B, Hkv, g * S, hd)
    scores = jnp.matmul(qg, k_cache, preferred_element_type=_acc(q.dtype)) / math.sqrt(hd)
    scores = jnp.where(mask[:, None, None], scores.reshape(B, Hkv, g, S, T), -1e30)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype).reshape(B, Hkv, g * S, T)
    out = jnp.matmul(probs, v_cache).reshape(B, Hkv, g, S, hd)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, S, Hq * hd)


def forward_cached(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array,
                   cache: KVCache, write_index: jax.Array, new_valid: jax.Array, *,
                   lora: Params | None = None, lora_scale: float = 1.0, dtype=jnp.float32,
                   last_only: bool = False, window: int | None = None):
    """Run `tokens` [B, S] (written at cache slots write_index..write_index+S-1, the same slots for
    every row) against the cache. Returns (logits [B, S, V] float32, updated cache).

    Used for prefill (S = padded prompt length, write_index = 0) and decode (S = 1). `last_only`
    computes logits for the last position only (prefill needs no others; the LM head is costly).
    `window` (static) attends over cache slots [0, window) only, which the caller guarantees hold
    every slot written so far (write_index + S <= window): early decode steps then do not pay for
    the empty end of the cache.
    """
    B, S = tokens.shape
    T = cache.valid.shape[1]
    W = T if window is None else window
    if not 0 < W <= T:
        raise ValueError(f"window must be in (0, {T}], got {window}")
    valid = jax.lax.dynamic_update_slice(cache.valid, new_valid, (0, write_index))
    key_slot = jnp.arange(W)
    query_slot = write_index + jnp.arange(S)
    mask = (key_slot[None, :] <= query_slot[:, None])[None] & valid[:, None, :W]  # [B, S, W]
    H, hd = cfg.num_kv_heads, cfg.head_dim

    def body(carry, xs):
        x, k_cache, v_cache, i = carry
        lp, lo = xs

        def attn_fn(q, k, v):
            kc = jax.lax.dynamic_update_slice(k_cache, k.transpose(0, 2, 3, 1)[None].astype(k_cache.dtype),
                                              (i, 0, 0, 0, write_index))
            vc = jax.lax.dynamic_update_slice(v_cache, v.transpose(0, 2, 1, 3)[None].astype(v_cache.dtype),
                                              (i, 0, 0, write_index, 0))
            k_all = jax.lax.dynamic_slice(kc, (i, 0, 0, 0, 0), (1, B, H, hd, W))[0].astype(q.dtype)
            v_all = jax.lax.dynamic_slice(vc, (i, 0, 0, 0, 0), (1, B, H, W, hd))[0].astype(q.dtype)
            return cached_attention(q, k_all, v_all, mask), (kc, vc)

        x, (k_cache, v_cache) = _layer(cfg, x, lp, lo, lora_scale, positions, attn_fn)
        return (x, k_cache, v_cache, i + 1), None

    x = embed(params, tokens, dtype)
    (x, k, v, _), _ = jax.lax.scan(body, (x, cache.k, cache.v, jnp.int32(0)), (params["layers"], lora))
    return unembed(params, cfg, x[:, -1:] if last_only else x), KVCache(k, v, valid)


def cast_params(params: Params, dtype) -> Params:
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
