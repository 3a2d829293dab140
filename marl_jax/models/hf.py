"""Hugging Face checkpoint folders (config.json + safetensors) to and from marl_jax params."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Any, Mapping

import numpy as np

from marl_jax.models.decoder import ModelConfig, config_from_hf, config_to_hf

# How the frozen base is held (model.param_dtype). auto: the checkpoint's own dtype where that is bfloat16
# (lossless, half the bytes of float32), float32 otherwise (float32 / float16 / float64 tensors, dequantized
# GGUF: casting those to bfloat16 would change values).
PARAM_DTYPES = ("auto", "float32", "bfloat16")

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


def resolve_param_dtype(param_dtype, storage=()) -> np.dtype:
    """The numpy dtype the frozen base is held in: "float32" | "bfloat16" | "auto" (see PARAM_DTYPES), or a
    numpy / jax dtype as is. `storage`: the stored dtypes of the tensors the model reads (auto only)."""
    import ml_dtypes

    if not isinstance(param_dtype, str):
        return np.dtype(param_dtype)
    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r} is not one of {list(PARAM_DTYPES)}")
    bf16 = np.dtype(ml_dtypes.bfloat16)
    if param_dtype == "auto":
        storage = [np.dtype(d) for d in storage]
        return bf16 if storage and all(d == bf16 for d in storage) else np.dtype(np.float32)
    return bf16 if param_dtype == "bfloat16" else np.dtype(np.float32)


def _stored_dtypes(sd: Mapping[str, Any], names) -> list[np.dtype]:
    """Stored dtypes of `names`: from a lazy mapping's headers when it knows them (no tensor is read)."""
    known = getattr(sd, "dtypes", None)
    return [np.dtype(known[n]) if known is not None and n in known else np.asarray(sd[n]).dtype for n in names]


def _leaf_builders(cfg: ModelConfig, sd: Mapping[str, np.ndarray], dtype) -> list[tuple[tuple[str, ...], Any]]:
    """(param path, builder) for every marl_jax leaf; a builder reads its HF tensors (one stacked leaf at a
    time: `sd` may be lazy) and returns the numpy leaf in `dtype` (resolve_param_dtype over the tensors the
    model reads). Missing tensors are reported up front."""
    wanted = {("embed",): ("model.embed_tokens.weight", False), ("final_norm",): ("model.norm.weight", False)}
    if not cfg.tie_word_embeddings:
        wanted[("lm_head",)] = ("lm_head.weight", True)
    names = [n for n, _ in wanted.values()]
    for key in _layer_keys(cfg):
        names += [f"model.layers.{i}.{_LAYER_MAP[key][0]}" for i in range(cfg.num_layers)]
    missing = [n for n in names if n not in sd]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the {cfg.family} config needs: {shown}")
    auto = isinstance(dtype, str) and dtype == "auto"
    dtype = resolve_param_dtype(dtype, _stored_dtypes(sd, names) if auto else ())

    def view(name, transpose):
        t = np.asarray(sd[name])
        return t.T if transpose else t

    def one(name, transpose):
        return np.array(view(name, transpose), dtype=dtype, order="C")  # one copy, never a view of the file

    def stacked(hf_name, transpose):
        out = None  # filled layer by layer straight from the tensors: no per-layer temporaries
        for i in range(cfg.num_layers):
            t = view(f"model.layers.{i}.{hf_name}", transpose)
            if out is None:
                out = np.empty((cfg.num_layers,) + t.shape, dtype)
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
    """HF-named tensors ([out, in] matrices) -> stacked marl_jax params (numpy, `dtype`: a PARAM_DTYPES
    name or a numpy dtype)."""
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


def state_dict_from_params(cfg: ModelConfig, params: Mapping, dtype=np.float32) -> dict[str, np.ndarray]:
    """Inverse of params_from_state_dict (numpy in `dtype`, HF names and layouts)."""
    sd = {"model.embed_tokens.weight": np.asarray(params["embed"], dtype),
          "model.norm.weight": np.asarray(params["final_norm"], dtype)}
    for key in _layer_keys(cfg):
        hf_name, transpose = _LAYER_MAP[key]
        stacked = np.asarray(params["layers"][key], dtype)
        for i in range(cfg.num_layers):
            t = stacked[i]
            sd[f"model.layers.{i}.{hf_name}"] = np.ascontiguousarray(t.T if transpose else t)
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = np.ascontiguousarray(np.asarray(params["lm_head"], dtype).T)
    return sd


def tree_dtype(params: Mapping) -> np.dtype:
    """The one dtype every leaf of `params` has, float32 when they differ."""
    import jax

    dts = {np.dtype(x.dtype) for x in jax.tree_util.tree_leaves(params)}
    return dts.pop() if len(dts) == 1 else np.dtype(np.float32)


def _safetensors_files(path: pathlib.Path) -> list[pathlib.Path]:
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
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"shard {f} listed in the index is missing")
    return files


def read_state_dict(path: str | os.PathLike, lazy: bool = False) -> Mapping[str, np.ndarray]:
    """All tensors of a folder's model.safetensors or sharded model.safetensors.index.json, in their stored
    dtypes (bfloat16 as ml_dtypes.bfloat16); with `lazy`, a mapping that reads (memory-mapped) each tensor
    only when it is looked up and knows every tensor's dtype from the headers."""
    loaders, dtypes = {}, {}
    for f in _safetensors_files(pathlib.Path(path)):
        got, dts = _read_safetensors(f)
        loaders.update(got)
        dtypes.update(dts)
    if lazy:
        return LazyTensors(loaders, dtypes)
    return {name: np.array(load()) for name, load in loaders.items()}  # copies: nothing left on the file map


def storage_dtypes(path: str | os.PathLike) -> dict[str, np.dtype]:
    """Each tensor's stored dtype in a Hugging Face folder, read from the safetensors headers only."""
    out = {}
    for f in _safetensors_files(pathlib.Path(path)):
        out.update(_read_safetensors(f)[1])
    return out


class LazyTensors(Mapping):
    """A state dict whose values are computed on lookup (name -> zero-argument loader); `dtypes` (name ->
    dtype, optional) says what each lookup returns without computing it."""

    def __init__(self, loaders: Mapping[str, Any], dtypes: Mapping[str, Any] | None = None):
        self._loaders = dict(loaders)
        self.dtypes = None if dtypes is None else dict(dtypes)

    def __getitem__(self, name):
        return self._loaders[name]()

    def __iter__(self):
        return iter(self._loaders)

    def __len__(self):
        return len(self._loaders)


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _read_safetensors(f: pathlib.Path) -> tuple[dict[str, Any], dict[str, np.dtype]]:
    """Memory-mapped safetensors reader that also handles bfloat16 (numpy has no bf16, ml_dtypes has):
    ({name: loader returning a read-only view of the file in the stored dtype}, {name: stored dtype})."""
    import ml_dtypes

    buf = np.memmap(f, dtype=np.uint8, mode="r")
    n = int(np.frombuffer(buf[:8].tobytes(), "<u8")[0])
    header = json.loads(buf[8:8 + n].tobytes())
    out, dtypes = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = ml_dtypes.bfloat16 if info["dtype"] == "BF16" else _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{f}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]

        def load(dt=dt, start=start, end=end, shape=info["shape"]):
            return np.frombuffer(buf[8 + n + start: 8 + n + end], dtype=dt).reshape(shape)

        out[name], dtypes[name] = load, np.dtype(dt)
    return out, dtypes


def load_hf_dir(path: str | os.PathLike, dtype=np.float32, mesh=None, rules=None) -> tuple[ModelConfig, dict]:
    """(config, params) of a folder: numpy params, or with a mesh sharded jax arrays placed leaf by leaf;
    `dtype` as params_from_state_dict ("auto" keeps a bfloat16 checkpoint in bfloat16)."""
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face model folder needs config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
    # Lazy either way: each tensor is read from the file map straight into its leaf, one leaf at a time.
    sd = read_state_dict(path, lazy=True)
    if mesh is not None:
        return cfg, place_state_dict(cfg, sd, mesh, rules, dtype)
    return cfg, params_from_state_dict(cfg, sd, dtype)


def save_hf_dir(path: str | os.PathLike, cfg: ModelConfig, params: Mapping, tokenizer=None,
                dtype=np.float32) -> pathlib.Path:
    """Write config.json + model.safetensors (tensors in `dtype`, + tokenizer files) that transformers loads."""
    from safetensors.numpy import save_file

    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf_cfg = {**config_to_hf(cfg), "torch_dtype": np.dtype(dtype).name}  # what from_pretrained(dtype="auto") picks
    (path / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    save_file(state_dict_from_params(cfg, params, dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_hf_dir(path)
    return path
