"""Placement of parameters and decode state on a ("data", "model") device mesh.

Rules are per parameter kind: projections into heads / MLP hidden are split on their output axis
over "model", projections back to the residual stream on their input axis, the vocabulary on
"model"; norms are replicated. Batch axes go on "data". A dimension that the axis size does not
divide is left unsplit, so any checkpoint works on any mesh (just less sharded).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# Spec per parameter name, over its shape without the leading layer axis.
_RULES = {
    "embed": ("model", None),
    "lm_head": (None, "model"),
    "final_norm": (None,),
    "wq": (None, "model"), "wk": (None, "model"), "wv": (None, "model"),
    "bq": ("model",), "bk": ("model",), "bv": ("model",),
    "wo": ("model", None),
    "w_gate": (None, "model"), "w_up": (None, "model"),
    "w_down": ("model", None),
}


def make_mesh(data: int = -1, model: int = 1, devices=None) -> Mesh:
    """A 2-D mesh; data=-1 takes every device not used by the model axis."""
    devices = np.asarray(jax.devices() if devices is None else devices)
    n = devices.size
    if data == -1:
        if n % model:
            raise ValueError(f"model axis {model} does not divide the {n} devices")
        data = n // model
    if data * model != n:
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, have {n}; "
                         "set mesh.data=-1 to use every device")
    return Mesh(devices.reshape(data, model), ("data", "model"),
                axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _fit(spec: tuple, shape: tuple, mesh: Mesh) -> P:
    """Drop mesh axes that do not divide their dimension."""
    out = []
    for ax, dim in zip(spec, shape):
        out.append(ax if ax is not None and dim % mesh.shape[ax] == 0 else None)
    return P(*out)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    name = path[-1]
    in_layers = "layers" in path
    rule = _RULES.get(name)
    if rule is None:  # norms and anything unknown: replicated
        return P(*([None] * len(shape)))
    lead = len(shape) - len(rule)  # layer axis (and slot axis for stacked adapters)
    return _fit((None,) * lead + rule, shape, mesh) if (in_layers or lead == 0) else P(*([None] * len(shape)))


def _path_names(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def param_shardings(params: Any, mesh: Mesh) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, param_spec(_path_names(path), x.shape, mesh)), params)


def shard_params(params: Any, mesh: Mesh) -> Any:
    return jax.device_put(params, param_shardings(params, mesh))


def batch_spec(shape: tuple[int, ...], mesh: Mesh, batch_axis: int = 0) -> P:
    spec = [None] * len(shape)
    spec[batch_axis] = "data"
    return _fit(tuple(spec), shape, mesh)


def constrain_state(state, mesh: Mesh, cfg) -> Any:
    """Sharding constraints for the sampler's DecodeState: batch on "data", KV heads on "model"."""
    from marl_jax.generate.sampler import DecodeState
    from marl_jax.models.decoder import KVCache

    def c(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    kv = _fit((None, "data", "model", None, None), state.cache.k.shape, mesh)  # [L, B, Hkv, ., .]
    cache = KVCache(c(state.cache.k, kv), c(state.cache.v, kv),
                    c(state.cache.valid, batch_spec(state.cache.valid.shape, mesh)))
    rest = {f: c(getattr(state, f), batch_spec(getattr(state, f).shape, mesh))
            for f in ("token", "pos", "active", "out_tokens", "out_logp", "row_id", "max_len")}
    return DecodeState(cache=cache, step=state.step, **rest)


def to_host(x) -> np.ndarray:
    """A jax.Array as a numpy array on every process. Arrays sharded across processes (multi-host)
    are all-gathered, so each host's Python logic (stopping, compaction, rollouts) sees the same values."""
    if isinstance(x, jax.Array) and not (x.is_fully_addressable or x.is_fully_replicated):
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
