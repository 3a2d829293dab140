"""Trainable parameters with a leading slot axis: LoRA adapters (default) or full weights.

LoRA on layer matrix W [in, out]: y = x W + (alpha / rank) * (x A) B with A [in, r], B [r, out].
A starts random and B at zero, so every slot equals the frozen base model at step 0.
Trainable pytrees carry the slot axis first: LoRA {name: {"a": [S, L, in, r], "b": [S, L, r, out]}},
full weights: the whole param tree with [S, ...] on every leaf.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from marl_jax.models.decoder import LINEAR_NAMES, ModelConfig

# Friendly aliases users know from PEFT configs.
_ALIASES = {"q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo",
            "gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """What is trainable. mode: "lora" | "full"."""

    mode: str = "lora"
    rank: int = 64
    alpha: float = 32.0
    targets: tuple[str, ...] = LINEAR_NAMES
    num_slots: int = 1

    def __post_init__(self):
        if self.mode not in ("lora", "full"):
            raise ValueError(f"policy mode must be 'lora' or 'full', got {self.mode!r}")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {self.num_slots}")
        if self.mode == "lora":
            if self.rank < 1:
                raise ValueError(f"lora rank must be >= 1, got {self.rank}")
            bad = [t for t in self.targets if _ALIASES.get(t, t) not in LINEAR_NAMES]
            if bad:
                raise ValueError(f"unknown LoRA target(s) {bad}; choose from {list(LINEAR_NAMES)} "
                                 f"or their HF names {list(_ALIASES)}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def target_names(self) -> tuple[str, ...]:
        return tuple(_ALIASES.get(t, t) for t in self.targets)


def _io(cfg: ModelConfig, name: str) -> tuple[int, int]:
    d, f = cfg.hidden_size, cfg.intermediate_size
    return {"wq": (d, cfg.q_dim), "wk": (d, cfg.kv_dim), "wv": (d, cfg.kv_dim), "wo": (cfg.q_dim, d),
            "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}[name]


def init_trainable(spec: PolicySpec, cfg: ModelConfig, base: Any, key: jax.Array) -> Any:
    """Slot-stacked trainable pytree; every slot starts identical (and equal to the base model)."""
    S = spec.num_slots
    if spec.mode == "full":
        # Trained weights are float32 (a bfloat16 base would round every small update away): the copies are
        # upcast, and so are their gradients and optimizer moments.
        return jax.tree_util.tree_map(
            lambda x: jnp.broadcast_to(jnp.asarray(x, _trained_dtype(x.dtype)), (S,) + x.shape).copy(), base)
    out = {}
    L = cfg.num_layers
    for i, name in enumerate(spec.target_names):
        fan_in, fan_out = _io(cfg, name)
        # PEFT's default: kaiming-uniform A (bound 1/sqrt(fan_in)), zero B.
        a = jax.random.uniform(jax.random.fold_in(key, i), (L, fan_in, spec.rank), jnp.float32,
                               -1.0 / fan_in ** 0.5, 1.0 / fan_in ** 0.5)
        out[name] = {"a": jnp.broadcast_to(a, (S,) + a.shape), "b": jnp.zeros((S, L, spec.rank, fan_out), jnp.float32)}
    return out


def _trained_dtype(dtype):
    """float32 for a bfloat16 / float16 / float32 base (float64 stays float64: parity checks under x64)."""
    return jnp.promote_types(dtype, jnp.float32)


def slot_params(spec: PolicySpec, base: Any, trainable: Any, slot) -> tuple[Any, Any]:
    """(params, lora) for one slot, `slot` may be traced. The decoder takes lora as layer-stacked xs."""
    one = jax.tree_util.tree_map(lambda x: x[slot], trainable)
    if spec.mode == "full":
        return one, None
    return base, one


def unstacked(spec: PolicySpec, base: Any, one_slot: Any) -> tuple[Any, Any]:
    """(params, lora) from a single slot's trainable tree (no slot axis), for vmapped training."""
    return (one_slot, None) if spec.mode == "full" else (base, one_slot)


def merge_lora(spec: PolicySpec, base: Any, trainable: Any, slot: int) -> Any:
    """Base params with one slot's adapters folded in (for export / serving). Folded matrices are float32
    even over a bfloat16 base: W + (alpha / r) A B is the weight the policy computes with, and bfloat16
    would round small adapters away; untouched leaves keep the base's dtype."""
    params, lora = slot_params(spec, base, trainable, slot)
    if lora is None:
        return jax.tree_util.tree_map(lambda x: x, params)
    layers = dict(params["layers"])
    for name, ab in lora.items():
        delta = jnp.einsum("lir,lro->lio", ab["a"], ab["b"]) * spec.scale
        w = jnp.asarray(layers[name])
        layers[name] = w.astype(_trained_dtype(w.dtype)) + delta.astype(_trained_dtype(w.dtype))
    return {**params, "layers": layers}


def count_params(tree: Any) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(tree))


def parse_targets(targets: str | Sequence[str]) -> tuple[str, ...]:
    """'all' or a comma-separated list ('q_proj,v_proj' or 'wq,wv')."""
    if isinstance(targets, str):
        if targets in ("all", "all-linear", ""):
            return LINEAR_NAMES
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return tuple(targets)
