"""A character-level tokenizer and tiny random decoders: fast end-to-end runs (tests, demos) with no files."""
from __future__ import annotations

import string

import jax

from marl_jax.models import decoder
from marl_jax.models.loading import LoadedModel
from marl_jax.models.tokenizer import Tokenizer

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


def char_tokenizer(alphabet: str = ALPHABET) -> Tokenizer:
    """One token per character plus ChatML specials; <|im_end|> stops, <|endoftext|> pads."""
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for ch in dict.fromkeys(alphabet):
        vocab.setdefault(ch, len(vocab))
    backend = Backend(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def tiny_model(tokenizer: Tokenizer | None = None, *, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, seed: int = 0, family: str = "qwen3") -> LoadedModel:
    """A random decoder sized for the tokenizer's vocabulary (qk-norm Qwen3 flavour by default)."""
    tok = tokenizer or char_tokenizer()
    cfg = decoder.ModelConfig(family=family, vocab_size=tok.vocab_size, hidden_size=hidden,
                              intermediate_size=2 * hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                              head_dim=hidden // heads, qk_norm=family == "qwen3", qkv_bias=family == "qwen2",
                              rope_theta=10000.0, tie_word_embeddings=True)
    params = jax.tree_util.tree_map(lambda x: jax.device_get(x), decoder.init_params(cfg, jax.random.PRNGKey(seed)))
    return LoadedModel(cfg, params, tok, f"tiny-random-{family}")
