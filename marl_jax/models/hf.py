"""Hugging Face checkpoint folders (config.json + safetensors) to and from marl_jax params."""
from __future__ import annotations

import json
import os
import pathlib
from typing import Mapping

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


def params_from_state_dict(cfg: ModelConfig, sd: Mapping[str, np.ndarray], dtype=np.float32) -> dict:
    """HF-named tensors ([out, in] matrices) -> stacked marl_jax params (numpy, `dtype`)."""
    missing = []

    def get(name):
        if name not in sd:
            missing.append(name)
            return None
        return np.asarray(sd[name])

    layers = {}
    for key in _layer_keys(cfg):
        hf_name, transpose = _LAYER_MAP[key]
        per_layer = [get(f"model.layers.{i}.{hf_name}") for i in range(cfg.num_layers)]
        if any(t is None for t in per_layer):
            continue
        stacked = np.stack([t.T if transpose else t for t in per_layer])
        layers[key] = stacked.astype(dtype)
    params = {"embed": get("model.embed_tokens.weight"), "layers": layers, "final_norm": get("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        head = get("lm_head.weight")
        params["lm_head"] = None if head is None else head.T
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ValueError(f"checkpoint lacks {len(missing)} tensor(s) the {cfg.family} config needs: {shown}")
    params["embed"] = params["embed"].astype(dtype)
    params["final_norm"] = params["final_norm"].astype(dtype)
    if "lm_head" in params:
        params["lm_head"] = np.ascontiguousarray(params["lm_head"]).astype(dtype)
    return params


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


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a folder's model.safetensors or sharded model.safetensors.index.json."""
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
        sd.update(_read_safetensors(f))
    return sd


_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32,
              "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


def _read_safetensors(f: pathlib.Path) -> dict[str, np.ndarray]:
    """Memory-mapped safetensors reader that also handles bfloat16 (numpy has no bf16)."""
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
        arr = np.frombuffer(buf[8 + n + start: 8 + n + end], dtype=dt).reshape(info["shape"])
        out[name] = arr.astype(np.float32) if arr.dtype.kind == "f" or dt is ml_dtypes.bfloat16 else np.array(arr)
    return out


def load_hf_dir(path: str | os.PathLike, dtype=np.float32) -> tuple[ModelConfig, dict]:
    path = pathlib.Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{cfg_file} not found: a Hugging Face model folder needs config.json")
    cfg = config_from_hf(json.loads(cfg_file.read_text()))
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
