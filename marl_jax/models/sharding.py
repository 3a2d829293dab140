"""Placement on a ("data", "fsdp", "model") device mesh, by logical axis names and a rules table.

Every parameter and the main activations carry logical axis names (marl_jax.models.decoder:
LAYER_AXES, TOP_AXES, the ACT_* names, KV_AXES). A rules table maps each name to mesh axes, as
MaxText's `logical_axis_rules` does; the default, "fsdp_tp":

    batch            -> ("data", "fsdp")   rows of a batch, sampler and update alike
    embed            -> "fsdp"             the model dimension of every weight (FSDP: each device
                                           holds 1/fsdp of each matrix, gathered layer by layer)
    heads, kv_heads, mlp, vocab -> "model" tensor parallelism (and the matching activations)
    layers, slot, lora_rank, norm, head_dim, length, act_embed -> unsplit

A dimension that its mesh axes do not divide stays unsplit (any checkpoint runs on any mesh, just
less sharded), mesh axes of size 1 are dropped, and a mesh axis is used once per array.

Trainable trees (a leading slot axis), optimizer moments and gradient accumulators (which mirror
the parameter paths) get their names from the same tables by path: a leaf named like a parameter
takes that parameter's names, with "slot" (or nothing) for extra leading axes.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from marl_jax.models.axes import LAYER_AXES, LINEAR_NAMES, MESH_AXES, ROW_AXES, TOP_AXES

_ACTIVATIONS = (("batch", ROW_AXES), ("length", None), ("act_embed", None), ("act_heads", "model"),
                ("act_kv_heads", "model"), ("act_mlp", "model"), ("act_vocab", "model"))
_UNSPLIT = (("layers", None), ("slot", None), ("lora_rank", None), ("norm", None), ("head_dim", None))
RULES = {
    # FSDP over the weights' model dimension, tensor parallelism over heads / MLP / vocabulary.
    "fsdp_tp": _ACTIVATIONS + _UNSPLIT + (("embed", "fsdp"), ("heads", "model"), ("kv_heads", "model"),
                                          ("mlp", "model"), ("vocab", "model")),
    # Tensor parallelism only: weights replicated over data and fsdp.
    "tp": _ACTIVATIONS + _UNSPLIT + (("embed", None), ("heads", "model"), ("kv_heads", "model"),
                                     ("mlp", "model"), ("vocab", "model")),
    # Pure data parallelism: every weight replicated, rows split.
    "dp": (("batch", ROW_AXES),),
}
DEFAULT_RULES = "fsdp_tp"


def parse_rules(text: str = DEFAULT_RULES) -> tuple:
    """A rules table from config text: a preset name, optionally followed by overrides,
    e.g. "fsdp_tp" or "fsdp_tp;vocab=none;embed=fsdp+model"."""
    parts = [p.strip() for p in str(text or DEFAULT_RULES).split(";") if p.strip()]
    if parts[0] not in RULES:
        raise ValueError(f"mesh.rules preset {parts[0]!r} is unknown; choose from {sorted(RULES)} "
                         "(optionally followed by overrides like ';vocab=none;embed=fsdp+model')")
    table = dict(RULES[parts[0]])
    for part in parts[1:]:
        name, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"mesh.rules override {part!r} must look like logical_name=axis[+axis] or =none")
        axes = tuple(a for a in value.strip().split("+") if a and a.lower() != "none")
        bad = [a for a in axes if a not in MESH_AXES]
        if bad:
            raise ValueError(f"mesh.rules override {part!r}: unknown mesh axis {bad}; mesh axes are {MESH_AXES}")
        table[name.strip()] = axes or None
    return tuple(table.items())


def make_mesh(data: int = -1, model: int = 1, devices=None, *, fsdp: int = 1) -> Mesh:
    """A ("data", "fsdp", "model") mesh; data=-1 takes every device not used by fsdp x model."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    n = devices.size
    for name, size in (("fsdp", fsdp), ("model", model)):
        if size < 1:
            raise ValueError(f"mesh.{name} must be >= 1, got {size}")
    if data == -1:
        if n % (fsdp * model):
            raise ValueError(f"mesh fsdp={fsdp} x model={model} does not divide the {n} devices; "
                             f"pick sizes whose product divides {n}")
        data = n // (fsdp * model)
    if data * fsdp * model != n:
        raise ValueError(f"mesh data={data} x fsdp={fsdp} x model={model} needs {data * fsdp * model} devices, "
                         f"have {n}; set mesh.data=-1 to use every device")
    return Mesh(devices.reshape(data, fsdp, model), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3)


def spec_for(names: Sequence[str | None] | None, shape: Sequence[int], mesh: Mesh, rules=None) -> P:
    """PartitionSpec for an array whose axes have these logical names. Mesh axes that are missing,
    of size 1, already used, or that do not divide their dimension are dropped (trailing ones first)."""
    if names is None:
        return P(*([None] * len(shape)))
    table = dict(parse_rules() if rules is None else rules)
    used: set[str] = set()
    out = []
    for name, dim in zip(names, shape):
        axes = table.get(name) if name is not None else None
        axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
        axes = tuple(a for a in axes if mesh.shape.get(a, 1) > 1 and a not in used)
        while axes and dim % math.prod(mesh.shape[a] for a in axes):
            axes = axes[:-1]
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return P(*out)


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def logical_axes(path: Sequence[str], ndim: int) -> tuple | None:
    """Logical names of a parameter-like leaf from its path: base params, slot-stacked trainable trees,
    LoRA adapters ({name: {"a", "b"}}), optimizer moments and gradient accumulators. None: unknown
    (replicated)."""
    name = path[-1] if path else ""
    parent = path[-2] if len(path) > 1 else ""
    if name in ("a", "b") and parent in LINEAR_NAMES:
        io = LAYER_AXES[parent]
        axes = ("layers",) + ((io[0], "lora_rank") if name == "a" else ("lora_rank", io[1]))
    elif name in LAYER_AXES and "layers" in path:
        axes = ("layers",) + LAYER_AXES[name]
    elif name in TOP_AXES:
        axes = TOP_AXES[name]
    else:
        return None
    extra = ndim - len(axes)
    if extra < 0:
        return None
    return (("slot",) + (None,) * (extra - 1) if extra else ()) + axes


def tree_specs(tree: Any, mesh: Mesh, rules=None) -> Any:
    """PartitionSpecs for every leaf of a parameter-like tree (see logical_axes)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: spec_for(logical_axes(_path_names(path), np.ndim(x)), np.shape(x), mesh, rules), tree)


def tree_shardings(tree: Any, mesh: Mesh, rules=None) -> Any:
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), tree_specs(tree, mesh, rules),
                                  is_leaf=lambda s: isinstance(s, P))


# The names the rest of the code has always used.
param_shardings = tree_shardings


def shard_params(params: Any, mesh: Mesh, rules=None) -> Any:
    return jax.device_put(params, tree_shardings(params, mesh, rules))


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules=None) -> P:
    return spec_for(logical_axes(path, len(shape)), shape, mesh, rules)


def row_count(mesh: Mesh | None) -> int:
    """Devices the rows of a batch are split over (data x fsdp)."""
    return 1 if mesh is None else math.prod(mesh.shape.get(a, 1) for a in ROW_AXES)


def batch_spec(shape: tuple[int, ...], mesh: Mesh, batch_axis: int = 0, rules=None) -> P:
    names = [None] * len(shape)
    names[batch_axis] = "batch"
    return spec_for(names, shape, mesh, rules)


def batch_sharding(x, mesh: Mesh, batch_axis: int = 0, rules=None) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(np.shape(x), mesh, batch_axis, rules))


def compiled_outputs(compiled) -> Any:
    """A compiled program's outputs as abstract values with the shardings it gives them: programs lowered on
    these are the ones later calls on the real outputs find in jit's cache (on a mesh an abstract value without
    its sharding is another cache key, and the call compiles again)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                  compiled.out_info)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def constrain(x, names, mesh: Mesh, rules=None):
    """with_sharding_constraint by logical names (inside jit)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec_for(names, x.shape, mesh, rules)))


def constrain_state(state, mesh: Mesh, rules=None) -> Any:
    """Sharding constraints for the sampler's decode state: rows on data x fsdp, KV heads on "model".
    The cache type names its own axes (KVCache.AXES, PagedCache.AXES: a paged pool has a part per row
    shard, KV heads over "model")."""
    c = lambda x, names: constrain(x, names, mesh, rules)
    cache = type(state.cache)(*(c(x, n) for x, n in zip(state.cache, type(state.cache).AXES)))
    rest = {f: c(getattr(state, f), ("batch",) + (None,) * (getattr(state, f).ndim - 1))
            for f in ("token", "pos", "step", "active", "out_tokens", "out_logp", "row_id", "max_len")}
    return state._replace(cache=cache, **rest)


def bytes_per_device(tree: Any) -> int:
    """Bytes of a tree's arrays held by one device (the first addressable one)."""
    dev = None
    total = 0
    for x in jax.tree_util.tree_leaves(tree):
        shards = x.addressable_shards
        dev = dev or shards[0].device
        total += sum(s.data.nbytes for s in shards if s.device == dev)
    return total


def to_device(tree):
    """Host values (numpy arrays, Python scalars) as jax Arrays by a plain transfer. `jnp.asarray` of a numpy
    array compiles a small identity program per new shape (jax's `stage`), which would count as a compile in
    every step whose host shapes are new."""
    return jax.device_put(tree)


def to_host(x) -> np.ndarray:
    """A jax.Array as a numpy array on every process. Arrays sharded across processes (multi-host)
    are all-gathered, so each host's Python logic (stopping, compaction, rollouts) sees the same values."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
