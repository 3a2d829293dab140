"""XLA's own numbers for a run's programs, compiled from abstract arrays: `python -m marl_jax.plan --aot`.

Three programs of a training step, built from the project's own functions (nothing is run, no array is
allocated): one update item at the token budget (rl.update's per-row loss terms of one slot's micro-batch and
their VJP: the gradient of that slot's adapters or weights), one prefill chunk (decoder.forward_cached over
`rollout.prefill_chunk` tokens against a cache of the prompt's slots) and one decode step at
`rollout.max_batch` rows over the paged pool of the KV budget's blocks (decoder.forward_cached with a
decoder.init_paged PagedCache). Each is lowered with the run's mesh and shardings and compiled for

  - the local devices (CPU here: what the tests check the planner against at small shapes), or
  - a TPU slice without a TPU: libtpu's compile-only devices from
    jax.experimental.topologies.get_topology_desc (install with `pip install -e ".[aot]"`).

GPUs cannot be compiled for without one: jax's CUDA plugin needs a visible device to create its client.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from marl_jax.models import decoder, sharding
from marl_jax.models.decoder import ModelConfig

AOT_INSTALL = 'pip install -e ".[aot]"'
# TPU slice name -> libtpu topology (chips): v4 / v5p names count TensorCores (2 per chip).
TOPOLOGIES = {"v4": ("v4", 3), "v5p": ("v5p", 3), "v5e": ("v5e", 2), "v6e": ("v6e", 2)}


def topology_name(kind: str, chips: int) -> str:
    """'v5p', 4 -> 'v5p:2x2x1'; 'v5e', 8 -> 'v5e:2x4'; 'v6e', 4 -> 'v6e:2x2'."""
    name, dims = TOPOLOGIES[kind]
    if dims == 3:
        shapes = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"}
    else:
        shapes = {4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
    if chips not in shapes:
        raise ValueError(f"no {kind} topology of {chips} chips here; use one of {sorted(shapes)} chips")
    return f"{name}:{shapes[chips]}"


def tpu_devices(kind: str, chips: int):
    """Compile-only devices of a TPU slice (libtpu), or a ValueError saying how to install it."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        raise ValueError(f"--aot compiles for a TPU slice with libtpu, which is not installed: {AOT_INSTALL}")
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(topology_name=topology_name(kind, chips), platform="tpu")
    return topo.devices


@dataclasses.dataclass(frozen=True)
class Program:
    name: str
    fn: Any  # a jitted function
    args: tuple  # abstract arguments (ShapeDtypeStruct with shardings)


def _abstract(tree, shardings):
    return jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _base(cfg, dtype, mesh, rules):
    params = jax.eval_shape(lambda: decoder.init_params(cfg, jax.random.PRNGKey(0), dtype))
    return _abstract(params, sharding.tree_shardings(params, mesh, rules))


def _rows(tree, mesh, rules):
    return _abstract(tree, jax.tree_util.tree_map(lambda x: sharding.batch_sharding(x, mesh, 0, rules), tree))


def update_item(cfg: ModelConfig, *, rows: int, T: int, W: int, mesh, rules=None, mode: str = "lora", rank: int = 64,
                remat: str = "full", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, metrics: bool = True) -> Program:
    """One update work item: rows x T tokens of one slot, W scored positions; its loss terms and gradient."""
    from marl_jax.policy.lora import PolicySpec, init_trainable
    from marl_jax.rl.update import UpdateConfig, _row_terms

    spec = PolicySpec(mode=mode, rank=rank, alpha=32.0, num_slots=1)
    ucfg = UpdateConfig(micro_batch=rows, remat=remat, dtype=dtype, metrics=metrics)
    base = _base(cfg, param_dtype, mesh, rules)
    one = jax.eval_shape(lambda b: jax.tree_util.tree_map(lambda x: x[0], init_trainable(
        spec, cfg, b, jax.random.PRNGKey(1))), jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                                                      base))
    one = _abstract(one, sharding.tree_shardings(one, mesh, rules))
    sd = jax.ShapeDtypeStruct
    r = {"tokens": sd((rows, T), jnp.int32), "valid": sd((rows, T), bool), "win_start": sd((rows,), jnp.int32),
         "targets": sd((rows, W), jnp.int32), "loss_mask": sd((rows, W), jnp.float32),
         "old_logp": sd((rows, W), jnp.float32), "advantages": sd((rows,), jnp.float32),
         "kl_coef": sd((rows,), jnp.float32)}
    r = _rows(r, mesh, rules)
    cot = _rows(sd((rows,), jnp.float32), mesh, rules)

    def item(mine, base, r, cot):
        terms = lambda tr: _row_terms(cfg, spec, ucfg, base, tr, r, mesh, rules, norm_len=W, remat=remat)
        nums, vjp, aux = jax.vjp(terms, mine, has_aux=True)
        (g,) = vjp(cot.astype(nums.dtype))
        return jnp.sum(nums), g

    return Program("update item", jax.jit(item), (one, base, r, cot))


def _cache_shardings(cache, mesh, rules):
    axes = type(cache).AXES
    return type(cache)(*(jax.sharding.NamedSharding(mesh, sharding.spec_for(n, x.shape, mesh, rules))
                         for x, n in zip(cache, axes)))


def prefill_chunk(cfg: ModelConfig, *, rows: int, chunk: int, prompt: int, mesh, rules=None, dtype=jnp.bfloat16,
                  param_dtype=jnp.bfloat16) -> Program:
    """One prefill chunk: `rows` distinct prompts' `chunk` tokens written into a cache of `prompt` slots, attending
    to every slot before them (the last chunk of a long prompt: the widest window)."""
    params = _base(cfg, param_dtype, mesh, rules)
    cache = jax.eval_shape(lambda: decoder.init_cache(cfg, rows, prompt, dtype))
    cache = _abstract(cache, _cache_shardings(cache, mesh, rules))
    sd = jax.ShapeDtypeStruct
    toks = _rows({"tokens": sd((rows, chunk), jnp.int32), "positions": sd((rows, chunk), jnp.int32),
                  "valid": sd((rows, chunk), bool)}, mesh, rules)
    start = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding.replicated(mesh))

    def run(params, cache, t, start):
        return decoder.forward_cached(params, cfg, t["tokens"], t["positions"], cache, start, t["valid"],
                                      dtype=dtype, last_only=True, window=prompt, mesh=mesh, rules=rules)

    return Program("prefill chunk", jax.jit(run, donate_argnums=(1,)), (params, cache, toks, start))


def decode_step(cfg: ModelConfig, *, rows: int, blocks: int, block: int, window: int, mesh, rules=None,
                dtype=jnp.bfloat16, param_dtype=jnp.bfloat16) -> Program:
    """One decode step: `rows` rows, one token each, over a paged pool of `blocks` blocks of `block` slots per
    row shard, attending over `window` slots through their block tables."""
    params = _base(cfg, param_dtype, mesh, rules)
    shards = sharding.row_count(mesh)
    cache = jax.eval_shape(lambda: decoder.init_paged(cfg, blocks, block, rows, window, shards, dtype))
    cache = _abstract(cache, _cache_shardings(cache, mesh, rules))
    sd = jax.ShapeDtypeStruct
    t = _rows({"tokens": sd((rows, 1), jnp.int32), "positions": sd((rows, 1), jnp.int32),
               "write": sd((rows,), jnp.int32), "valid": sd((rows, 1), bool)}, mesh, rules)

    def run(params, cache, t):
        return decoder.forward_cached(params, cfg, t["tokens"], t["positions"], cache, t["write"], t["valid"],
                                      dtype=dtype, window=window, mesh=mesh, rules=rules)

    return Program("decode step", jax.jit(run, donate_argnums=(1,)), (params, cache, t))


def analyse(program: Program) -> dict[str, float]:
    """Compile (never run) and read XLA's per-device bytes and its cost analysis."""
    import time
    t0 = time.perf_counter()
    compiled = program.fn.lower(*program.args).compile()
    ma = compiled.memory_analysis()
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else (ca or {})
    return {"arguments": float(ma.argument_size_in_bytes), "temporaries": float(ma.temp_size_in_bytes),
            "outputs": float(ma.output_size_in_bytes), "aliased": float(getattr(ma, "alias_size_in_bytes", 0)),
            "flops": float(ca.get("flops", 0.0)), "bytes_accessed": float(ca.get("bytes accessed", 0.0)),
            "compile_s": time.perf_counter() - t0}
