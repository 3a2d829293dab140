"""Tiny random Hugging Face checkpoints written with save_pretrained (tests only; needs torch)."""
from __future__ import annotations

import pathlib

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
            rms_norm_eps=1e-6)


def make_tiny_hf(family: str, out_dir: pathlib.Path, *, tie: bool = False, seed: int = 0,
                 num_kv_heads: int | None = None) -> pathlib.Path:
    import torch
    import transformers

    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    kw = dict(TINY, tie_word_embeddings=tie, rope_theta=10000.0 if family == "llama" else 1e6)
    if num_kv_heads is not None:
        kw["num_key_value_heads"] = num_kv_heads
    cfg = cls[0](**kw)
    torch.manual_seed(seed)
    model = cls[1](cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: randomise them so they are tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out_dir)
    return out_dir
