"""Tokenizer parity with transformers (GGUF tokenizer, saved folders, chat templates) and with tiktoken (Qwen)."""
from __future__ import annotations

import random
import unicodedata

import jinja2
import numpy as np
import pytest

from marl_jax.models.embedded import embedded_gguf_path
from marl_jax.models.gguf import write_gguf
from marl_jax.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
gguf = pytest.importorskip("gguf")


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def gguf_path():
    return embedded_gguf_path("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def ours(gguf_path):
    return Tokenizer.from_gguf(gguf_path)


@pytest.fixture(scope="module")
def ref(gguf_path):
    """transformers' own tokenizer for the GGUF file."""
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def ref_smollm2_split(ref):
    """transformers' GGUF tokenizer with the pre-tokenizer SmolLM2's hub tokenizer.json declares (every digit
    split off, then GPT-2 byte-level), which is also llama.cpp's `smollm` pre-tokenizer."""
    backend = tokenizers.Tokenizer.from_str(ref.backend_tokenizer.to_str())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
        tokenizers.pre_tokenizers.Digits(individual_digits=True),
        tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    return backend


_PIECES = [
    "hello", "World", " the", "don't", "I'M", "we'll", "naïve", "café", "Straße", "日本語", "中文测试", "Ελληνικά",
    "русский", "עברית", "😀", "👍🏽", "🇫🇷", "\u200b", "½", "²", "٣", "Ⅻ", "x=1", "if", "return", "def", "{", "}",
    "(", ")", "==", "->", "//", "#", "'s", "'ll", "0", "1", "2", "7", "9", "123", "3.14", "-42", "1,000", "2024",
    " ", "  ", "   ", "    ", "\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "<file_sep>", "<jupyter_code>", "<|im_start", "im_end|>", "$", "%", "@", "\\", "...", "—",
]
_FIXED = [
    "", " ", "a", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "    indented code",
    "x = 12345 + 678", "=  5", "\n\n7", "a  1", "1  2  3", "3.14159265358979", "Version 2.0.1-beta",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|endoftext|>",
    "The answer is \\boxed{42}.", "Émilie's café — naïve résumé", "日本語のテキストと English mixed",
    "emoji 😀😀😀 and flags 🇺🇸🇯🇵", "     \n\n\n     ", "a" * 200, "ab" * 50 + " " + "9" * 30,
    "\u00a0\u00a0nbsp", "ｆｕｌｌｗｉｄｔｈ １２３", "tricky ' s and 's and 'S", "\\n is not a newline",
]


def _strings(n_random: int = 300, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = list(_FIXED)
    for _ in range(n_random):
        out.append("".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 12))))
    return out


STRINGS = _strings()


def _space_run_before_number(s: str) -> bool:
    """Two or more whitespace characters right before a numeric one: where GPT-2's split and a digits-first split
    disagree (GPT-2 gives the last space to the number)."""
    return any(s[i].isnumeric() and s[i - 1].isspace() and s[i - 2].isspace() for i in range(2, len(s)))


# ------------------------------------------------------------------------------------ text <-> ids

def test_encode_matches_transformers_gguf_tokenizer(ours, ref):
    compared = 0
    for s in STRINGS:
        if _space_run_before_number(s):
            continue
        assert ours.encode(s) == ref.encode(s, add_special_tokens=False), repr(s)
        compared += 1
    assert compared >= 250


def test_encode_matches_smollm2_pretokenizer_on_all_strings(ours, ref_smollm2_split):
    assert sum(map(_space_run_before_number, STRINGS)) >= 20  # the cases where the two splits differ are covered
    for s in STRINGS:
        assert ours.encode(s) == ref_smollm2_split.encode(s, add_special_tokens=False).ids, repr(s)


def test_digits_split_off_after_whitespace_runs(ours, ref):
    """llama.cpp's `smollm` pre-tokenizer splits "\\p{N}" first, so a whitespace run before a digit stays whole."""
    ids = ref.convert_tokens_to_ids
    assert ours.encode("=  5") == ids(["=", "ĠĠ", "5"])
    assert ours.encode("\n\n7") == ids(["ĊĊ", "7"])
    assert ours.encode("x 42") == ids(["x", "Ġ", "4", "2"])


def test_decode_matches_transformers(ours, ref):
    for s in STRINGS:
        ids = ours.encode(s)
        assert ours.decode(ids, skip_special_tokens=False) == s  # byte-level BPE is lossless
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), repr(s)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    rng = np.random.default_rng(0)
    for _ in range(100):  # arbitrary id sequences, special ids included, partial UTF-8 included
        ids = rng.integers(0, ours.vocab_size, size=rng.integers(1, 20)).tolist() + [0, 1, 2]
        rng.shuffle(ids)
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)


def test_special_token_facts(ours, ref):
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token) == (
        ref.bos_token, ref.eos_token, ref.pad_token, ref.unk_token)
    assert ours.bos_id == ref.bos_token_id and ours.pad_id == ref.pad_token_id
    assert ours.eos_token_ids[0] == ref.eos_token_id
    assert ref.convert_tokens_to_ids("<|im_end|>") in ours.eos_token_ids
    assert ref.convert_tokens_to_ids("<|endoftext|>") in ours.eos_token_ids
    assert ours.vocab_size == len(ref)
    assert ours.chat_template == ref.chat_template


# ------------------------------------------------------------------------------------------------ chat

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": "Solve x^2 = 9.\nShow steps."}],
    [{"role": "system", "content": "Réponds en français."}, {"role": "user", "content": "Combien font 7×6 ?"},
     {"role": "assistant", "content": "42 😀"}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_matches_transformers(ours, ref, add_generation_prompt):
    for conv in CONVERSATIONS:
        text = ours.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
        assert text == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt)
        expected = ref.apply_chat_template(conv, tokenize=True, return_dict=False,
                                           add_generation_prompt=add_generation_prompt)
        assert ours.encode_chat(conv, add_generation_prompt=add_generation_prompt) == list(expected)

# Templates exercising the Jinja features chat templates rely on: namespaces, loop controls, trim/lstrip
# blocks, tojson (non-ASCII kept), raise_exception, special-token variables, strings methods.
_FEATURE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m.role == 'bad' %}{{ raise_exception('bad role: ' + m.role) }}{% endif %}
    {% if m.role == 'skip' %}{% continue %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    [{{ ns.n }}:{{ m.role | upper }}] {{ m.content | trim }}{{ eos_token }}
    {% if m.meta is defined %}{{ m.meta | tojson }}{% endif %}
{% endfor %}
{% if tools %}{% for t in tools %}<tool>{{ t | tojson(indent=2) }}</tool>{% endfor %}{% endif %}
{% if add_generation_prompt %}[ASSISTANT]{% if enable_thinking is defined and not enable_thinking %}(fast){% endif %}
{% endif %}"""


def _with_template(tok: Tokenizer, template: str) -> Tokenizer:
    return Tokenizer(tok.backend, bos_token=tok.bos_token, eos_token=tok.eos_token, pad_token=tok.pad_token,
                     unk_token=tok.unk_token, chat_template=template)


def test_template_environment_matches_transformers(ours, ref):
    mine = _with_template(ours, _FEATURE_TEMPLATE)
    theirs = transformers.PreTrainedTokenizerFast(
        tokenizer_object=ref.backend_tokenizer, bos_token=ref.bos_token, eos_token=ref.eos_token,
        pad_token=ref.pad_token, unk_token=ref.unk_token, chat_template=_FEATURE_TEMPLATE)
    conv = [{"role": "system", "content": "  sys  "}, {"role": "skip", "content": "hidden"},
            {"role": "user", "content": "ünïcödé", "meta": {"k": "é", "n": [1, 2]}},
            {"role": "assistant", "content": "ok", "tool_calls": None}]
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"a": "ñ"}}}]
    for gen in (True, False):
        for think in (True, False):
            assert mine.apply_chat_template(conv, add_generation_prompt=gen, enable_thinking=think, tools=tools) == \
                theirs.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen, enable_thinking=think,
                                           tools=tools)
    with pytest.raises(jinja2.TemplateError, match="bad role"):
        mine.apply_chat_template([{"role": "bad", "content": "x"}])


def test_default_chatml_template(ours):
    plain = _with_template(ours, None)
    assert plain.chat_template is None
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert plain.apply_chat_template(conv) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert plain.apply_chat_template(conv, add_generation_prompt=False).endswith("hi<|im_end|>\n")


# ------------------------------------------------------------------------------------ folders and files

def test_from_hf_dir_on_folder_saved_by_transformers(ref, tmp_path):
    ref.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_dir(tmp_path)
    for s in STRINGS:  # the folder carries transformers' own pre-tokenizer, so every string matches
        assert tok.encode(s) == ref.encode(s, add_special_tokens=False), repr(s)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert tok.eos_token_ids[0] == ref.eos_token_id
    for conv in CONVERSATIONS:
        assert tok.apply_chat_template(conv) == ref.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)


def test_save_hf_dir_loads_in_transformers(ours, tmp_path):
    ours.save_hf_dir(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    for s in STRINGS:
        ids = ours.encode(s)
        assert loaded.encode(s, add_special_tokens=False) == ids, repr(s)
        assert loaded.decode(ids, skip_special_tokens=True) == ours.decode(ids)
    assert (loaded.bos_token, loaded.eos_token, loaded.pad_token, loaded.unk_token) == (
        ours.bos_token, ours.eos_token, ours.pad_token, ours.unk_token)
    for conv in CONVERSATIONS:
        assert loaded.apply_chat_template(conv, tokenize=False, add_generation_prompt=True) == \
            ours.apply_chat_template(conv)
    again = Tokenizer.from_hf_dir(tmp_path)
    assert again.eos_token_ids == ours.eos_token_ids and again.pad_id == ours.pad_id
    assert all(again.encode(s) == ours.encode(s) for s in STRINGS)


def test_gguf_fields_round_trip(ours, tmp_path):
    """A GGUF written with our tokenizer metadata reads back to the same tokenizer (and the gguf package agrees)."""
    config = dict(model_type="llama", vocab_size=ours.vocab_size, hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    rng = np.random.default_rng(0)
    state = {"model.embed_tokens.weight": rng.standard_normal((ours.vocab_size, 32), dtype=np.float32),
             "model.norm.weight": np.ones(32, np.float32)}
    write_gguf(tmp_path / "t.gguf", config, state, tokenizer_fields=ours.gguf_fields())
    back = Tokenizer.from_gguf(tmp_path / "t.gguf")
    assert back.eos_token_ids == ours.eos_token_ids and back.bos_id == ours.bos_id
    assert back.chat_template == ours.chat_template
    assert all(back.encode(s) == ours.encode(s) for s in STRINGS)
    reader = gguf.GGUFReader(str(tmp_path / "t.gguf"))
    assert reader.fields["tokenizer.ggml.tokens"].contents()[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)
    w = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>", "▁a"])
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ValueError, match="only byte-level BPE"):
        Tokenizer.from_gguf(tmp_path / "spm.gguf")


# ------------------------------------------------------------------------------------------------ Qwen3

QWEN_PAT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
            r"""\s*[\r\n]+|\s+(?!\S)|\s+""")  # Qwen's published tiktoken split pattern


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    import marl_jax.models.qwen_tokenizer as qt

    ranks_path = qt.find_qwen_tiktoken()  # the README's test command installs dashscope, which ships it
    out = qt.qwen3_tokenizer_dir(tmp_path_factory.mktemp("qwen3"))
    return qt, out, Tokenizer.from_hf_dir(out), ranks_path


@pytest.fixture(scope="module")
def qwen_tiktoken(qwen):
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    qt, _, _, ranks_path = qwen
    ranks = load_tiktoken_bpe(str(ranks_path))
    specials = {t: qt.QWEN_BPE_SIZE + i for i, (t, _) in enumerate(qt.QWEN3_ADDED_TOKENS)}
    return tiktoken.Encoding("qwen", pat_str=QWEN_PAT, mergeable_ranks=ranks, special_tokens=specials)


def test_qwen_matches_tiktoken(qwen, qwen_tiktoken):
    _, _, tok, _ = qwen
    extra = ["<think>\nreasoning\n</think>\n\nanswer", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
             "Qwen3 是一个大语言模型。", "  12345  678 \n\n 9"]
    for s in STRINGS + extra:
        s = unicodedata.normalize("NFC", s)  # Qwen's tokenizer.json normalizes to NFC; tiktoken does not
        assert tok.encode(s) == qwen_tiktoken.encode(s, allowed_special="all"), repr(s)
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_qwen_facts_and_transformers_load(qwen):
    _, out, tok, _ = qwen
    assert tok.vocab_size == 151669
    assert tok.eos_token_ids == (151645, 151643) and tok.pad_id == 151643 and tok.bos_id is None
    assert tok.decode(tok.encode("<|im_end|>x<think>")) == "x<think>"  # <think> is not a special token
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    for s in STRINGS:
        s = unicodedata.normalize("NFC", s)
        assert loaded.encode(s, add_special_tokens=False) == tok.encode(s), repr(s)


def test_qwen3_thinking_switch(qwen, qwen_tiktoken):
    _, out, tok, _ = qwen
    loaded = transformers.AutoTokenizer.from_pretrained(str(out))
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"}, {"role": "user", "content": "3+3?"}]
    off = tok.apply_chat_template(conv, enable_thinking=False)
    on = tok.apply_chat_template(conv, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"
    assert "add" not in off  # reasoning of earlier turns is dropped by the template
    for think in (True, False):
        assert tok.apply_chat_template(conv, enable_thinking=think) == loaded.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=True, enable_thinking=think)
    assert tok.encode_chat(conv, enable_thinking=False) == qwen_tiktoken.encode(off, allowed_special="all")
    tools = [{"type": "function", "function": {"name": "calc", "description": "Evaluate.",
                                               "parameters": {"type": "object", "properties": {"e": {"type": "string"}}}}}]
    calls = conv[:2] + [{"role": "assistant", "content": "",
                         "tool_calls": [{"function": {"name": "calc", "arguments": {"e": "2+2"}}}]},
                        {"role": "tool", "content": "4"}]
    assert tok.apply_chat_template(calls, tools=tools) == loaded.apply_chat_template(
        calls, tools=tools, tokenize=False, add_generation_prompt=True, enable_thinking=False)


def test_qwen_gguf_tokenizer(qwen, qwen_tiktoken, tmp_path):
    """A Qwen-style GGUF (pre 'qwen2') builds the same tokenizer as the folder."""
    _, _, tok, _ = qwen
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), "qwen3")
    for k, v in tok.gguf_fields().items():
        if k == "tokenizer.ggml.token_type":
            w.add_token_types(v)
        elif isinstance(v, list):
            w.add_array(k, v)
        elif isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    back = Tokenizer.from_gguf(tmp_path / "q.gguf")
    assert back.eos_token_ids == tok.eos_token_ids
    for s in STRINGS[:120]:
        s = unicodedata.normalize("NFC", s)
        assert back.encode(s) == qwen_tiktoken.encode(s, allowed_special="all"), repr(s)


def test_library_path_needs_no_torch_or_transformers(gguf_path):
    """Loading weights and tokenizer from the GGUF imports neither torch nor transformers."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from marl_jax.models.gguf import read_gguf\n"
        "from marl_jax.models.tokenizer import Tokenizer\n"
        "import marl_jax.models.qwen_tokenizer, marl_jax.models.embedded\n"
        f"cfg, sd = read_gguf({str(gguf_path)!r})\n"
        f"tok = Tokenizer.from_gguf({str(gguf_path)!r})\n"
        "assert tok.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
