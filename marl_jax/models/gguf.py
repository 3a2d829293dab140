"""GGUF files <-> Hugging Face style (config dict, float32 state dict), without torch.

`read_gguf` turns a llama.cpp GGUF checkpoint of a Llama, Qwen2 or Qwen3 decoder into what a Hugging Face
folder would hold: the `config.json` dict and a state dict with HF tensor names and HF layouts ([out, in]),
dequantized to float32 numpy with the `gguf` package. `write_gguf` goes the other way (tests, export).

llama.cpp's converter permutes the rows of the q/k projections of `llama` models (its rotary kernel pairs
dimensions (2i, 2i+1), HF's pairs (i, i + d/2)); Qwen2/Qwen3 are written unpermuted. We undo the permutation
on read and apply it on write, as transformers' own GGUF loader does.
"""
from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
WRITE_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# GGUF tensor name (per block) <-> HF name (per layer).
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_HF_BLOCK_NAMES = {v: k for k, v in _BLOCK_NAMES.items()}
_HF_GLOBAL_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}


def _gguf():
    try:
        import gguf  # noqa: PLC0415 (optional heavy import kept local)
    except ImportError as e:  # pragma: no cover - gguf is an install requirement
        raise ImportError("Reading GGUF files needs the `gguf` package: pip install 'gguf>=0.16'") from e
    return gguf


# ----------------------------------------------------------------------------------------------- names

def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name for a GGUF tensor name, or None if the tensor has no HF counterpart."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        hf = _BLOCK_NAMES.get(m.group(2))
        return None if hf is None else f"model.layers.{m.group(1)}.{hf}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def hf_to_gguf_name(name: str) -> str:
    """GGUF tensor name for an HF parameter name; raises ValueError for names outside the decoder family."""
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if m and m.group(2) in _HF_BLOCK_NAMES:
        return f"blk.{m.group(1)}.{_HF_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(.+)\.(weight|bias)", name)
    if m and m.group(1) in _HF_GLOBAL_NAMES:
        return f"{_HF_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"Tensor {name!r} is not a Llama/Qwen2/Qwen3 decoder parameter; cannot name it in GGUF.")


# ------------------------------------------------------------------------------------ llama permutation

def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotary row order -> llama.cpp row order (llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `_permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rotary_heads(hf_name: str, config: Mapping[str, Any]) -> int | None:
    """Number of heads to (un)permute for this tensor under the llama convention, or None."""
    if ".self_attn.q_proj." in hf_name:
        return int(config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return int(config["num_key_value_heads"])
    return None


# ----------------------------------------------------------------------------------------------- read

# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lies in a GGUF file. `shape` is in numpy/HF order (GGUF lists dims fastest-first)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_gguf_header(path: str | os.PathLike) -> tuple[dict[str, Any], list[GGUFTensorInfo]]:
    """Parse a GGUF file's metadata and tensor table (no tensor data is read).

    A small direct parser of the (little-endian, v2/v3) format: `gguf.GGUFReader` builds a numpy view per
    array element, which costs seconds on a 49k-token vocabulary.
    """
    gguf = _gguf()
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"No GGUF file at {path!r}.")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        if len(mm) < 24 or mm[:4] != b"GGUF":
            raise ValueError(f"{path!r} is not a GGUF file (no 'GGUF' magic at its start).")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", mm, 4)
        if version not in (2, 3):
            raise ValueError(f"{path!r}: GGUF version {version} is not supported (2 or 3 expected; "
                             "big-endian files are not supported either).")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", mm, pos)
            s = mm[pos + 8:pos + 8 + n].decode("utf-8")
            pos += 8 + n
            return s

        def value(vtype: int) -> Any:
            nonlocal pos
            if vtype == 8:
                return string()
            if vtype == 9:
                etype, count = struct.unpack_from("<IQ", mm, pos)
                pos += 12
                if etype in _SCALAR_FORMATS and etype != 7:
                    fmt = "<" + _SCALAR_FORMATS[etype]
                    arr = np.frombuffer(mm, dtype=np.dtype(fmt), count=count, offset=pos).tolist()
                    pos += struct.calcsize(fmt) * count
                    return arr
                return [value(etype) for _ in range(count)]
            fmt = _SCALAR_FORMATS.get(vtype)
            if fmt is None:
                raise ValueError(f"{path!r}: unknown GGUF value type {vtype} at byte {pos}.")
            (v,) = struct.unpack_from("<" + fmt, mm, pos)
            pos += struct.calcsize(fmt)
            return v

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            (vtype,) = struct.unpack_from("<I", mm, pos)
            pos += 4
            meta[key] = value(vtype)
        raw = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from("<I", mm, pos)
            dims = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", mm, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            raw.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
        align = int(meta.get("general.alignment", 32))
        data_start = (pos + align - 1) // align * align
    tensors = []
    for name, shape, ggml_type, offset in raw:
        try:
            block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError) as e:
            raise ValueError(f"GGUF tensor {name!r} has unknown ggml type {ggml_type}; upgrade gguf.") from e
        nbytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
        tensors.append(GGUFTensorInfo(name, shape, ggml_type, data_start + offset, nbytes))
    return meta, tensors


def _f32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (9.9999997e-06 -> 1e-05)."""
    return float(str(np.float32(x)))


def _dequantize(info: GGUFTensorInfo, data: np.ndarray) -> np.ndarray:
    """Float32 copy of one tensor, from the file's bytes (`data`: uint8 map of the whole file)."""
    gguf = _gguf()
    kind = gguf.GGMLQuantizationType(info.ggml_type)
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    if info.shape[-1] % block:
        raise ValueError(f"GGUF tensor {info.name!r}: row of {info.shape[-1]} is not whole {kind.name} blocks.")
    row_bytes = info.shape[-1] // block * type_size
    raw = data[info.offset:info.offset + info.nbytes].reshape(*info.shape[:-1], row_bytes)
    try:
        flat = gguf.quants.dequantize(raw, kind)
    except NotImplementedError as e:
        raise ValueError(
            f"GGUF tensor {info.name!r} has type {kind.name}, which the installed `gguf` package cannot "
            "dequantize. Re-export the model as F16/BF16/Q8_0/Q4_0/Q4_1, or upgrade gguf (pip install -U gguf)."
        ) from e
    return np.array(flat, dtype=np.float32).reshape(info.shape)  # a copy: never a view of the file map


def read_gguf_config(path: str | os.PathLike) -> dict:
    """Only the HF config dict of a GGUF file (no tensor data is read)."""
    return _config_from_header(*read_gguf_header(path))


def _config_from_header(meta: Mapping[str, Any], tensors: list[GGUFTensorInfo]) -> dict:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}. "
            "Convert such a model from its Hugging Face safetensors folder instead."
        )
    names = {t.name: t for t in tensors}
    if "rope_freqs.weight" in names or meta.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        raise ValueError(
            "This GGUF uses RoPE scaling (rope_freqs / rope.scaling.*), which read_gguf does not map to an HF "
            "config; load the model from its Hugging Face safetensors folder instead."
        )

    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    missing = [k for k in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length")
               if key(k) is None]
    if missing:
        raise ValueError(f"GGUF metadata lacks {[f'{arch}.{k}' for k in missing]}; the file is incomplete.")
    n_heads = int(key("attention.head_count"))
    n_kv = int(key("attention.head_count_kv", n_heads))
    hidden = int(key("embedding_length"))
    emb = names.get("token_embd.weight")
    if emb is None:
        raise ValueError("GGUF file has no token_embd.weight tensor; it is not a decoder-only LM checkpoint.")
    q = names.get("blk.0.attn_q.weight")
    # The q projection's rows fix head_dim (Qwen3 has head_dim != hidden / heads; key_length says it too).
    head_dim = int(key("attention.key_length", q.shape[0] // n_heads if q is not None else hidden // n_heads))
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "vocab_size": int(emb.shape[0]),
        "max_position_embeddings": int(key("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        config["mlp_bias"] = False
    return config


def read_gguf(path: str | os.PathLike, lazy: bool = False) -> tuple[dict, Mapping[str, np.ndarray]]:
    """Read a Llama/Qwen2/Qwen3 GGUF file as (HF config dict, HF float32 state dict).

    Tensors keep HF names and layouts (`[out, in]` for projections); quantized types are dequantized with
    `gguf.quants.dequantize`. `lm_head.weight` is present only when the embeddings are not tied. With
    `lazy`, the state dict dequantizes each tensor only when it is looked up.
    """
    meta, tensors = read_gguf_header(path)
    config = _config_from_header(meta, tensors)
    unknown = [t.name for t in tensors if gguf_to_hf_name(t.name) is None]
    if unknown:
        raise ValueError(
            f"GGUF file has tensors outside the Llama/Qwen2/Qwen3 decoder family: {unknown[:8]}"
            f"{' ...' if len(unknown) > 8 else ''}; this model kind is not supported."
        )
    data = np.memmap(os.fspath(path), dtype=np.uint8, mode="r")
    for info in tensors:
        if info.offset + info.nbytes > data.shape[0]:
            raise ValueError(f"GGUF tensor {info.name!r} runs past the end of the file (truncated download?).")

    def load(info):
        w = _dequantize(info, data)
        if config["model_type"] == "llama" and (n := _rotary_heads(gguf_to_hf_name(info.name), config)) is not None:
            w = _unpermute(w, n)
        return w

    if lazy:
        from marl_jax.models.hf import LazyTensors
        return config, LazyTensors({gguf_to_hf_name(t.name): (lambda t=t: load(t)) for t in tensors},
                                   {gguf_to_hf_name(t.name): np.float32 for t in tensors})  # dequantized
    return config, {gguf_to_hf_name(t.name): load(t) for t in tensors}


# ---------------------------------------------------------------------------------------------- write

def _infer_value_type(key: str, value: Any):
    gguf = _gguf()
    T = gguf.GGUFValueType
    if isinstance(value, bool):
        return T.BOOL, None
    if isinstance(value, (int, np.integer)):
        return (T.INT32 if int(value) < 0 else T.UINT32), None
    if isinstance(value, (float, np.floating)):
        return T.FLOAT32, None
    if isinstance(value, str):
        return T.STRING, None
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"GGUF field {key!r}: empty arrays have no element type; drop the field.")
        if all(isinstance(v, str) for v in value):
            return T.ARRAY, T.STRING
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
            return T.ARRAY, T.INT32
        if all(isinstance(v, (float, np.floating)) for v in value):
            return T.ARRAY, T.FLOAT32
    raise ValueError(f"GGUF field {key!r}: unsupported value {type(value).__name__}; use str/int/float/bool or lists.")


def _tensor_type_for(w: np.ndarray, requested, block_size: int):
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    # As llama.cpp does: 1-D tensors (norms, biases) stay F32; quantized types need whole blocks per row.
    if w.ndim < 2 or requested == Q.F32:
        return Q.F32
    if requested in (Q.F16, Q.BF16) or w.shape[-1] % block_size == 0:
        return requested
    return Q.F16


def _rope_theta(hf_config: Mapping[str, Any]) -> float:
    """RoPE base of a config in either transformers 4 (`rope_theta`) or 5 (`rope_parameters`) style."""
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default"):
        raise ValueError(f"RoPE scaling {kind!r} cannot be written to GGUF here; only default RoPE is supported.")
    theta = hf_config.get("rope_theta", rope.get("rope_theta"))
    return float(10000.0 if theta is None else theta)


def write_gguf(
    path: str | os.PathLike,
    hf_config: Mapping[str, Any],
    hf_state_dict: Mapping[str, Any],
    tensor_type: str = "F32",
    tokenizer_fields: Mapping[str, Any] | None = None,
) -> None:
    """Write an HF decoder (config dict + state dict of arrays) as a GGUF file `read_gguf` reads back.

    tensor_type: one of WRITE_TENSOR_TYPES for 2-D tensors (1-D tensors stay F32; a quantized type whose block
    does not divide a row falls back to F16 for that tensor). tokenizer_fields: extra GGUF metadata with full
    key names (e.g. "tokenizer.ggml.tokens", "tokenizer.chat_template"), value types inferred
    ("tokenizer.ggml.token_type" is written as int32 array). Llama q/k rows are permuted to llama.cpp's order.
    """
    gguf = _gguf()
    arch = hf_config.get("model_type")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"model_type {arch!r} cannot be written; supported: {', '.join(SUPPORTED_ARCHITECTURES)}.")
    if tensor_type not in WRITE_TENSOR_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r} not supported; choose one of {WRITE_TENSOR_TYPES}.")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    block_size = gguf.GGML_QUANT_SIZES[qtype][0]

    n_heads = int(hf_config["num_attention_heads"])
    hidden = int(hf_config["hidden_size"])
    head_dim = int(hf_config.get("head_dim") or hidden // n_heads)
    config = {**hf_config, "num_key_value_heads": int(hf_config.get("num_key_value_heads") or n_heads)}

    writer = gguf.GGUFWriter(os.fspath(path), arch)
    writer.add_name(str(hf_config.get("_name_or_path") or arch))
    writer.add_context_length(int(hf_config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(hf_config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(hf_config["intermediate_size"]))
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_freq_base(_rope_theta(hf_config))
    writer.add_layer_norm_rms_eps(float(hf_config.get("rms_norm_eps", 1e-6)))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if hf_config.get("vocab_size") is not None:
        writer.add_vocab_size(int(hf_config["vocab_size"]))
    file_type = "ALL_F32" if tensor_type == "F32" else f"MOSTLY_{tensor_type}"
    writer.add_file_type(int(getattr(gguf.LlamaFileType, file_type)))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    fields = dict(tokenizer_fields or {})
    for key, gkey in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if isinstance(hf_config.get(key), int) and not isinstance(hf_config.get(key), bool):
            fields.setdefault(gkey, int(hf_config[key]))
    for k, v in fields.items():
        if k == "tokenizer.ggml.token_type":
            writer.add_key_value(k, [int(t) for t in v], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
            continue
        vtype, sub = _infer_value_type(k, v)
        writer.add_key_value(k, list(v) if sub is not None else v, vtype, sub)

    tied = bool(hf_config.get("tie_word_embeddings", False))
    for name, value in hf_state_dict.items():
        if tied and name == "lm_head.weight":
            continue  # tied: the file has no output.weight, which is how readers know
        w = np.asarray(value, dtype=np.float32)
        if arch == "llama" and (n := _rotary_heads(name, config)) is not None:
            w = _permute(w, n)
        gname = hf_to_gguf_name(name)
        kind = _tensor_type_for(w, qtype, block_size)
        data = gguf.quants.quantize(np.ascontiguousarray(w), kind)
        writer.add_tensor(gname, data, raw_dtype=kind)

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
