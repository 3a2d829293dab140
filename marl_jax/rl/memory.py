"""Bytes one update work item holds on one device: the memory model that remat="auto" (rl.update.remat_for)
and the planner (marl_jax.plan) share. A leaf: it imports nothing from the training path but the model's
shapes and attention's choice, so the planner can use it without the training path importing the planner.

The coefficients are counted from the decoder and checked against XLA's memory analysis of the real update
program, on CPU and (with libtpu) for TPU slices without a TPU (tests/test_plan.py, tests/test_plan_aot.py).
"""
from __future__ import annotations

import math

from marl_jax.models.decoder import ModelConfig

# An item's float32 logits above this are computed in chunks of positions (rl.update.head_chunk).
HEAD_BYTES = 256 * 2 ** 20


def attention_impl(cfg: ModelConfig, S: int, T: int, backend: str = "cpu") -> str:
    """What cfg.attention runs as for S queries over T keys on `backend` ("cpu" | "tpu" | "gpu"):
    marl_jax.models.attention.choose, without its layout (causal rows: what the update runs)."""
    from marl_jax.models.attention import choose
    return choose(getattr(cfg, "attention", "auto"), S, T, backend=backend)


def activation_bytes(cfg: ModelConfig, *, rows: float, T: int, W: int, remat: str, e: int = 4, rank: int = 0,
                     model_shards: int = 1, impl: str = "dense") -> float:
    """Temporaries of one update work item on one device: `rows` rows (on this device) of T tokens, the LM
    head over W scored positions, base weights computed in e-byte floats, LoRA rank `rank` (0: full
    training), heads and MLP columns split over `model_shards` devices, attention computed by `impl`
    ("dense" holds [rows, heads, T, T] scores; every other implementation is linear in T)."""
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    div = lambda n: model_shards if model_shards > 1 and n % model_shards == 0 else 1
    hq = cfg.num_heads // div(cfg.num_heads)
    qd, kvd = hq * cfg.head_dim, cfg.kv_dim // div(cfg.num_kv_heads)
    f = F // div(F)
    tok = rows * T
    # One layer, everything kept (per token): the residual stream, norms and their float32 statistics
    # (8 D wide), q before / after norm and rope and the attention output (6 q wide), k and v (5 kv
    # wide), the MLP's gate, up, sigmoid, silu and product (5 F wide), LoRA's x @ A (7, rank wide,
    # float32).
    layer_vectors = tok * (8 * D + 6 * qd + 5 * kvd + 5 * f) * e + tok * 7 * rank * 4
    if impl == "dense":
        # Per query-key pair the float32 scores and the probabilities, kept per layer.
        layer_attn, transient = rows * hq * T * T * (4 + e), 0.0
    else:
        # Memory-bounded attention (blockwise / splash / cuDNN) keeps per token only the log-sum-exp; its
        # backward (one layer at a time) holds float32 accumulators of dq, dk, dv and the blocks' output.
        # (blockwise, XLA's CPU memory analysis); splash and cuDNN keep theirs in their kernels' tiles, so
        # only dq, dk, dv remain (XLA's memory analysis for TPU, tests/test_plan_aot.py).
        layer_attn = tok * hq * 4
        transient = tok * (12 * qd + 10 * kvd) * 4 if impl == "blockwise" else tok * (2 * qd + 2 * kvd) * e
    layer = layer_vectors + layer_attn
    if remat == "none":
        # Every layer's activations, plus about one layer's cotangents in the backward pass.
        saved = (L + 0.75) * layer + transient
    elif remat == "dots":
        # The weight matmuls' outputs are kept (with LoRA, the adapter's too), the rest is recomputed one
        # layer at a time; that layer's attention and its cotangent are the transient.
        dots = tok * (2 * D + qd + 2 * kvd + 2 * f) * e * (2 if rank else 1) + tok * 7 * rank * 4
        saved = L * dots + 0.25 * layer_vectors + 2 * layer_attn + 2 * transient
    else:
        # Each layer's input (and its cotangent), plus one layer recomputed with its attention cotangent.
        saved = L * 2 * tok * D * e + layer_vectors + 1.5 * layer_attn + transient
    # The scored window's logits in float32, their softmax and its cotangent (the vocabulary split over
    # "model"); above HEAD_BYTES the head runs in chunks of positions, so a chunk's logits are the bound.
    logits = 3 * min(rows * W * V * 4 / div(V), HEAD_BYTES)
    return saved + logits


def remat_for(cfg: ModelConfig, rows: int, t: int, W: int, budget_bytes: float, *, dtype: str = "float32",
              rank: int = 0, backend: str | None = None) -> str:
    """The remat mode with the least recomputation ("none", then "dots") whose activations for one item
    of `rows` rows over t tokens (LM head on W positions) fit budget_bytes on one device, else "full"."""
    if backend is None:
        import jax
        backend = jax.default_backend()
    impl = attention_impl(cfg, t, t, backend)
    e = 2 if dtype == "bfloat16" else 4
    for mode in ("none", "dots"):
        if activation_bytes(cfg, rows=rows, T=t, W=W, remat=mode, e=e, rank=rank, impl=impl) <= budget_bytes:
            return mode
    return "full"


def budget_rows(budget: int, T: int) -> int:
    """Rows of T tokens a token-budget micro-batch holds (one at least: a longer row runs alone)."""
    return max(1, budget // T) if budget else 0


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b))
