"""One entry point from a model spec (HF folder, .gguf file or embedded name) to config, params, tokenizer."""
from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

import numpy as np

from marl_jax.models import embedded, hf
from marl_jax.models.decoder import ModelConfig, config_from_hf
from marl_jax.models.tokenizer import Tokenizer


class LoadedModel(NamedTuple):
    cfg: ModelConfig
    params: Any  # numpy pytree, or sharded jax arrays when loaded with a mesh
    tokenizer: Tokenizer
    source: str


def resolve(spec: str) -> tuple[str, pathlib.Path]:
    """('embedded' | 'gguf' | 'hf', path) for a model spec; raises with the fix when it is neither."""
    if embedded.is_embedded(spec):
        return "gguf", embedded.embedded_gguf_path(spec)
    path = pathlib.Path(os.path.expanduser(spec))
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir():
        return "hf", path
    raise FileNotFoundError(
        f"model {spec!r} is not an embedded name ({', '.join(sorted(embedded.EMBEDDED))}), "
        "a .gguf file or a Hugging Face checkpoint folder (config.json + safetensors)")


def load_model(spec: str, dtype=np.float32, mesh=None, rules=None) -> LoadedModel:
    """With a mesh, params come back as jax arrays already in their shardings (marl_jax.models.sharding),
    read and placed one leaf at a time; without, as a numpy pytree. `dtype`: how the params are held, a
    numpy dtype or one of hf.PARAM_DTYPES ("auto": a bfloat16 checkpoint stays bfloat16; GGUF tensors are
    dequantized to float32, so a GGUF model stays float32)."""
    kind, path = resolve(spec)
    if kind == "gguf":
        from marl_jax.models.gguf import read_gguf

        hf_cfg, sd = read_gguf(path, lazy=mesh is not None)
        cfg = config_from_hf(hf_cfg)
        params = (hf.params_from_state_dict(cfg, sd, dtype) if mesh is None
                  else hf.place_state_dict(cfg, sd, mesh, rules, dtype))
        tok = Tokenizer.from_gguf(path)
    else:
        tok = Tokenizer.from_hf_dir(path)  # first: a folder without tokenizer files fails before the weights load
        cfg, params = hf.load_hf_dir(path, dtype, mesh=mesh, rules=rules)
    return LoadedModel(cfg, params, tok, str(path))


def with_param_dtype(model: LoadedModel, dtype) -> LoadedModel:
    """`model` with its params held in `dtype` (as load_model's; "auto" leaves them as they are): for a
    model loaded elsewhere and handed in, so that an explicit model.param_dtype holds for it too."""
    if isinstance(dtype, str) and dtype == "auto":
        return model
    import jax

    dt = hf.resolve_param_dtype(dtype)
    return model._replace(params=jax.tree_util.tree_map(lambda x: x if x.dtype == dt else x.astype(dt), model.params))
