"""Hugging Face checkpoint folders (config.json + safetensors) to and from marl_jax params."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping

import numpy as np

from marl_jax.models.decoder import ModelConfig, config_from_hf, config_to_hf

# marl_jax layer key -> (HF name inside model.layers.{i}., transpose?)
_LAYER_MAP = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def _layer_keys(cfg: ModelConfig) -> list[str]:
    keys = ["attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"]
    if cfg.qkv_bias:
        keys += ["bq", "bk", "bv"]
    if cfg.qk_norm:
        keys += ["q_norm", "k_norm"]
    return keys


def _leaf_builders(cfg: ModelConfig, sd: Mapping[str, np.ndarray], dtype) -> list[tuple[tuple[str, ...], Any]]:
    """(param path, builder) for every marl_jax leaf; a builder reads its HF tensors (one stacked leaf at a
    time: `sd` may be lazy) and returns the numpy leaf in `dtype`. Missing tensors are reported up front."""
    wanted = {("embed",): ("model.embed_tokens.weight", False), ("final_norm",): ("model.norm.weight", False)}
    if not cfg.tie_word_embeddings:
        wanted[("lm_head",)] = ("lm_head.weight", True)
    missing = [n for n, _ in wanted.values() if n not in sd]
    for key in _layer_keys(cfg):
        missing += [f"model.layers.{i}.{_LAYER_MAP[key][0]}" for i in range(cfg.num_layers)
                    if f"model.layers.{i}.{_LAYER_MAP[key][0]}" not in sd]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the {cfg.family} config needs: {shown}")

    def one(name, transpose):
        t = np.asarray(sd[name])
        return np.ascontiguousarray(t.T if transpose else t, dtype=dtype)  # one copy, not two

    def stacked(hf_name, transpose):
        out = None  # filled layer by layer: one layer's temporaries at a time, not a list of all of them
        for i in range(cfg.num_layers):
            t = one(f"model.layers.{i}.{hf_name}", transpose)
            if out is None:
                out = np.empty((cfg.num_layers,) + t.shape, t.dtype)
            out[i] = t
        return out

    out = [(path, (lambda n=n, t=t: one(n, t))) for path, (n, t) in wanted.items()]
    out += [(("layers", key), (lambda k=key: stacked(*_LAYER_MAP[k]))) for key in _layer_keys(cfg)]
    return out


def _nest(items) -> dict:
    out: dict = {}
    for path, value in items:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = value
    return out


def params_from_state_dict(cfg: ModelConfig, sd: Mapping[str, np.ndarray], dtype=np.float32) -> dict:
    """HF-named tensors ([out, in] matrices) -> stacked marl_jax params (numpy, `dtype`)."""
    return _nest((path, build()) for path, build in _leaf_builders(cfg, sd, dtype))


def place_state_dict(cfg: ModelConfig, sd: Mapping[str, np.ndarray], mesh, rules=None, dtype=np.float32) -> dict:
    """Like params_from_state_dict, but each leaf goes straight into its sharding on `mesh` (from the
    logical axis rules) as it is read: the host holds one leaf at a time, each device only its shard."""
    import jax
    from jax.sharding import NamedSharding

    from marl_jax.models import sharding

    def place(path, build):
        arr = build()
        sh = NamedSharding(mesh, sharding.param_spec(path, arr.shape, mesh, rules))
        return jax.make_array_from_callback(arr.shape, sh, lambda idx: arr[idx])

    return _nest((path, place(path, build)) for path, build in _leaf_builders(cfg, sd, dtype))


def state_dict_from_params(cfg: ModelConfig, params: Mapping) -> dict[str, np.ndarray]:
    """Inverse of params_from_state_dict (float32 numpy, HF names and layouts)."""
    sd = {"model.embed_tokens.weight": np.asarray(params["embed"], np.float32),
          "model.norm.weight": np.asarray(params["final_norm"], np.float32)}
    for key in _layer_keys(cfg):
        hf_name, transpose = _LAYER_MAP[key]
        stacked = np.asarray(params["layers"][key], np.float32)
        for i in range(cfg.num_layers):
            t = stacked[i]
            sd[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(t.T if transpose else t)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"], np.float32).T)
    return sd


def read_state_dict(path: str | os.PathLike, lazy: bool = False) -> Mapping[str, np.ndarray]:
    """All tensors of a folder's model.safetensors or sharded model.safetensors.index.json; with `lazy`,
    a mapping that reads (memory-mapped) and converts each tensor only when it is looked up."""
    path = pathlib.Path(path)
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        raise FileNotFoundError(
            f"{path} has neither model.safetensors nor model.safetensors.index.json; "
            "point --model at a Hugging Face checkpoint folder (or a .gguf file)")
    sd = {}
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f} listed in the index is missing")
        sd.update(_read_safetensors(f, lazy))
    return LazyTensors(sd) if lazy else sd


class LazyTensors(Mapping):
    """A state dict whose values are computed on lookup (name -> zero-argument loader)."""

    def __init__(self, loaders: Mapping[str, Any]):
        self._loaders = dict(loaders)

    def __getitem__(self, name):
        return self._loaders[name]()

    def __iter__(self):
        return iter(self._loaders)

    def __len__(self):
        return len(self._loaders)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _read_safetensors(f: pathlib.Path, lazy: bool = False) -> dict[str, Any]:
    """Memory-mapped safetensors reader that also handles bfloat16 (numpy has no bf16). With `lazy`, the
    values are loaders that convert their tensor when called."""
    import ml_dtypes

    buf = np.memmap(f, dtype=np.uint8, mode="r")
    n = int(np.frombuffer(buf[:8].tobytes(), "<u8")[0])
    header = json.loads(buf[8:8 + n].tobytes())
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = ml_dtypes.bfloat16 if info["dtype"] == "BF16" else _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{f}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]

        def load(dt=dt, start=start, end=end, shape=info["shape"]):
            arr = np.frombuffer(buf[8 + n + start: 8 + n + end], dtype=dt).reshape(shape)
            return arr.astype(np.float32) if arr.dtype.kind == "f" or dt is ml_dtypes.bfloat16 else np.array(arr)

        out[name] = load if lazy else load()
    return out


def load_hf_dir(path: str | os.PathLike, dtype=np.float32, mesh=None, rules=None) -> tuple[ModelConfig, dict]:
    """(config, params) of a folder: numpy params, or with a mesh sharded jax arrays placed leaf by leaf."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face model folder needs config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    if mesh is not None:
        return cfg, place_state_dict(cfg, read_state_dict(path, lazy=True), mesh, rules, dtype)
    return cfg, params_from_state_dict(cfg, read_state_dict(path), dtype)


def save_hf_dir(path: str | os.PathLike, cfg: ModelConfig, params: Mapping, tokenizer=None) -> pathlib.Path:
    """Write config.json + model.safetensors (+ tokenizer files) that transformers loads."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg), indent=2))
    save_file(state_dict_from_params(cfg, params), str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_hf_dir(path)
    return path
