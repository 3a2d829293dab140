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


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "What is 2 + 2? The answer is 4.",
    "hello world, hello there", "def f(x):\n    return x * 2\n", "one two three four five six seven",
]


def save_tiny_tokenizer(out_dir: pathlib.Path, vocab_size: int = TINY["vocab_size"]) -> pathlib.Path:
    """A byte-level BPE of exactly `vocab_size` ids (ChatML specials first) saved with transformers'
    save_pretrained, so a tiny checkpoint folder is a complete model folder (weights + tokenizer)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_CORPUS * 20, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    fast.save_pretrained(out_dir)
    return out_dir


# Real chat prompts of mixed lengths (greedy parity needs real weights and real text to avoid near-ties).
CHAT_QUESTIONS = (
    "What is 7 + 5?", "Write a haiku about the sea.", "Name three primary colors.",
    "Explain gravity in one sentence.", "Translate 'good morning' to French.", "Hi!",
    "What is the capital of Japan? Answer in one word.",
    "List the first five prime numbers and explain why 1 is not prime.", "What is 12 * 3? Show your work.",
    "Give me a synonym for happy.", "Why is the sky blue?", "Write one sentence about cats.",
    "How many legs does a spider have?", "What is the boiling point of water in Celsius?",
    "Suggest a name for a pet goldfish.", "Summarize the plot of Romeo and Juliet in two sentences.",
)


def left_pad(prompts, pad_id: int):
    """(tokens [B, T] int64, mask [B, T] bool, position_ids [B, T] int64) for left-padded prompts,
    positions counting real tokens only (as transformers' generate computes them)."""
    import numpy as np

    T = max(len(p) for p in prompts)
    tokens = np.full((len(prompts), T), pad_id, np.int64)
    mask = np.zeros((len(prompts), T), bool)
    for i, p in enumerate(prompts):
        tokens[i, T - len(p):] = p
        mask[i, T - len(p):] = True
    return tokens, mask, np.maximum(np.cumsum(mask, 1) - 1, 0)
