"""Text <-> token ids and chat rendering, on the `tokenizers` library alone (no torch, no transformers).

`Tokenizer` wraps a `tokenizers.Tokenizer` with the few facts generation needs (stop ids, pad id, chat
template). It loads from a Hugging Face folder (`tokenizer.json` + `tokenizer_config.json`, ...) or builds a
byte-level BPE from a GGUF file's `tokenizer.ggml.*` fields, and renders chat templates with jinja2 the way
`transformers`' `apply_chat_template` does (same sandboxed environment, same variables).
"""
from __future__ import annotations

import json
import os
import pathlib
import warnings
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

# Used when a checkpoint ships no template (ChatML, as Qwen and SmolLM2 use).
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tokens that end a turn in common chat formats; any that is an added token of the vocabulary stops generation.
END_OF_TURN_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "<end_of_turn>", "<|end|>",
    "</s>",
)

# llama.cpp pre-tokenizer kinds (`tokenizer.ggml.pre`) -> how text is split before BPE. Each mirrors the
# `tokenizer.json` of the models llama.cpp names after, and llama.cpp's own split regexes (llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b", "command-r")
_LLAMA3_KINDS = ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "pixtral")
_QWEN2_KINDS = ("qwen2", "deepseek-r1-qwen", "megrez")

# GGUF token types (llama.cpp `llama_token_type`).
_TT_NORMAL, _TT_CONTROL, _TT_USER_DEFINED = 1, 3, 4


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what byte-level BPE vocabularies are spelled in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_level_pipeline(backend: _Backend, pre: str | None, add_prefix_space: bool = False) -> None:
    """Set normalizer/pre-tokenizer/decoder of a byte-level BPE for llama.cpp pre-tokenizer kind `pre`."""
    if pre in _QWEN2_KINDS or pre in _LLAMA3_KINDS:
        backend.normalizer = normalizers.NFC() if pre in _QWEN2_KINDS else None
        split = _QWEN2_SPLIT if pre in _QWEN2_KINDS else _LLAMA3_SPLIT
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ])
    elif pre in _DIGITS_THEN_GPT2:
        # These vocabularies were trained with every digit its own pre-token (llama.cpp: "\p{N}" first).
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True),
        ])
    else:  # "gpt2", "default" and kinds we do not know: GPT-2's own split
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)


def _token_str(value: Any) -> str | None:
    """A special-token entry of tokenizer_config.json (str or AddedToken dict) as its text."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and "content" in value:
        return str(value["content"])
    return None


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """A byte-level BPE (or any `tokenizers` model) plus the special-token facts that generation needs.

    Attributes: `backend` (the `tokenizers.Tokenizer`), `bos_token`, `eos_token`, `pad_token`, `unk_token`
    (strings or None), `chat_template` (Jinja source, or None when the checkpoint has none).
    """

    def __init__(
        self,
        backend: _Backend,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        gguf_pre: str | None = None,
    ):
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self._chat_template = chat_template
        self._compiled_template = None
        self.gguf_pre = gguf_pre
        extra_eos_ids = [int(i) for i in extra_eos_ids]
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            tok = getattr(self, name)
            if tok is not None and backend.token_to_id(tok) is None:
                raise ValueError(f"{name} {tok!r} is not in the vocabulary; fix the tokenizer files.")
        if eos_token is None and not extra_eos_ids:
            raise ValueError("Tokenizer has no eos token; set eos_token in tokenizer_config.json.")
        ids = [] if eos_token is None else [backend.token_to_id(eos_token)]
        # Only added tokens count: a plain BPE piece that happens to spell "</s>" is ordinary text.
        added = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        ids.extend(added[t] for t in END_OF_TURN_TOKENS if t in added)
        ids.extend(extra_eos_ids)
        self._eos_ids = tuple(dict.fromkeys(ids))

    @property
    def chat_template(self) -> str | None:
        """The checkpoint's Jinja chat template (None: it has none and ChatML is used)."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, template: str | None) -> None:
        self._chat_template, self._compiled_template = template, None

    # ------------------------------------------------------------------------------------ basic facts
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends generation: the eos id first, then end-of-turn tokens of the vocabulary."""
        return self._eos_ids

    @property
    def eos_id(self) -> int:
        return self._eos_ids[0]

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    @property
    def pad_id(self) -> int:
        """The pad token's id, or the eos id when the checkpoint names no pad token."""
        return self.eos_id if self.pad_token is None else self.backend.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (added tokens included)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(int(i))

    # ---------------------------------------------------------------------------------- text <-> ids
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text are matched, none is added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------------------- chat
    def _template(self):
        if self._compiled_template is None:
            self._compiled_template = _compile_template(self.chat_template or DEFAULT_CHAT_TEMPLATE)
        return self._compiled_template

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation with the checkpoint's Jinja template (ChatML if it has none).

        The template sees `messages`, `add_generation_prompt`, `enable_thinking`, the special tokens
        (`bos_token`, `eos_token`, `pad_token`, `unk_token`) and any extra `template_kwargs` (e.g. `tools`),
        exactly as under `transformers`' `apply_chat_template(..., tokenize=False)`.
        """
        chat = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise TypeError(f"Chat messages must be dicts with 'role' and 'content', got {m!r}.")
            chat.append({k: v for k, v in m.items() if v is not None})  # as transformers: drop None fields
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                    "pad_token": self.pad_token, "unk_token": self.unk_token}
        # As transformers: unset special tokens are undefined (not None); tools/documents default to None.
        variables = {**{k: v for k, v in specials.items() if v is not None}, "tools": None, "documents": None,
                     **template_kwargs}
        return self._template().render(
            messages=chat, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking, **variables
        )

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> list[int]:
        """`encode(apply_chat_template(messages, **kwargs))`."""
        return self.encode(self.apply_chat_template(messages, **kwargs))

    # -------------------------------------------------------------------------------- constructors
    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load from a Hugging Face folder: tokenizer.json plus, when present, tokenizer_config.json,
        special_tokens_map.json, chat_template.jinja / chat_template.json and generation_config.json."""
        root = pathlib.Path(path)
        tj = root / "tokenizer.json"
        if not tj.is_file():
            there = sorted(p.name for p in root.iterdir())[:12] if root.is_dir() else []
            spm = " (a SentencePiece tokenizer.model is there, which is not read: convert it as below)" \
                if (root / "tokenizer.model").is_file() else ""
            raise FileNotFoundError(
                f"model folder {root} has no tokenizer files: tokenizer.json not found{spm}; it holds {there}. "
                "Copy tokenizer.json and tokenizer_config.json from the model's original folder next to the "
                f"weights, or write them with transformers: AutoTokenizer.from_pretrained(src).save_pretrained('{root}')."
            )
        backend = _Backend.from_file(str(tj))

        def load(name: str) -> dict:
            p = root / name
            return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}

        cfg = {**load("special_tokens_map.json"), **load("tokenizer_config.json")}
        template = cfg.get("chat_template")
        if (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text(encoding="utf-8")
        elif (root / "chat_template.json").is_file():
            template = load("chat_template.json").get("chat_template", template)
        if isinstance(template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        gen = load("generation_config.json")
        model_cfg = load("config.json")
        extra = _as_ids(gen.get("eos_token_id")) + _as_ids(model_cfg.get("eos_token_id"))
        return cls(
            backend,
            bos_token=_token_str(cfg.get("bos_token")),
            eos_token=_token_str(cfg.get("eos_token")),
            pad_token=_token_str(cfg.get("pad_token")),
            unk_token=_token_str(cfg.get("unk_token")),
            chat_template=template,
            extra_eos_ids=[i for i in extra if i < backend.get_vocab_size(with_added_tokens=True)],
        )

    @classmethod
    def from_gguf(cls, path: str | os.PathLike) -> "Tokenizer":
        """Build the byte-level BPE described by a GGUF file's `tokenizer.ggml.*` metadata."""
        from marl_jax.models.gguf import read_gguf_header  # noqa: PLC0415 (only this constructor needs it)

        meta, _ = read_gguf_header(path)

        def field(key: str, default: Any = None) -> Any:
            return meta.get(key, default)

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'). Load the "
                "tokenizer from the model's Hugging Face folder instead: Tokenizer.from_hf_dir(dir)."
            )
        tokens: list[str] | None = field("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError(f"{os.fspath(path)!r} has no tokenizer.ggml.tokens; it carries no tokenizer.")
        types: list[int] = field("tokenizer.ggml.token_type") or [_TT_NORMAL] * len(tokens)
        merges: list[str] = field("tokenizer.ggml.merges") or []
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens are stored in the byte alphabet; a few files store raw text: respell those as transformers does.
        vocab = {
            (t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
            for i, t in enumerate(tokens)
        }
        pairs = [tuple(m.split(" ")) for m in merges]
        backend = _Backend(models.BPE(vocab, pairs, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
        pre = field("tokenizer.ggml.pre")
        if pre not in (None, "gpt2", "default", *_DIGITS_THEN_GPT2, *_LLAMA3_KINDS, *_QWEN2_KINDS):
            warnings.warn(f"GGUF pre-tokenizer {pre!r} is not known here; splitting text as GPT-2 does, which may "
                          "differ from the model's own tokenizer. Prefer Tokenizer.from_hf_dir for this model.")
        byte_level_pipeline(backend, pre, add_prefix_space=bool(field("tokenizer.ggml.add_space_prefix", False)))
        # Control tokens (<|im_end|> ...) are matched whole and skipped on decode; user-defined ones
        # (<think> ...) are matched whole but kept. Control tokens outside the byte alphabet are mislabels.
        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == _TT_CONTROL and set(t) <= alphabet]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == _TT_USER_DEFINED and t in vocab]
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)

        def tok(key: str) -> str | None:
            i = field(f"tokenizer.ggml.{key}")
            return None if i is None or not 0 <= int(i) < len(tokens) else tokens[int(i)]

        extra = [field(f"tokenizer.ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
        return cls(
            backend,
            bos_token=tok("bos_token_id"),
            eos_token=tok("eos_token_id"),
            pad_token=tok("padding_token_id"),
            unk_token=tok("unknown_token_id"),
            chat_template=field("tokenizer.chat_template"),
            extra_eos_ids=[int(i) for i in extra if i is not None],
            gguf_pre=pre,
        )

    # ------------------------------------------------------------------------------------------ export
    def save_hf_dir(self, path: str | os.PathLike) -> pathlib.Path:
        """Write tokenizer.json + tokenizer_config.json (+ special_tokens_map.json) that
        `transformers.AutoTokenizer.from_pretrained(path)` and `Tokenizer.from_hf_dir(path)` load."""
        root = pathlib.Path(path)
        root.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(root / "tokenizer.json"))
        specials = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token),
                                      ("pad_token", self.pad_token), ("unk_token", self.unk_token)) if v is not None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1_000_000_000,
            **specials,
        }
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (root / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False), encoding="utf-8")
        (root / "special_tokens_map.json").write_text(json.dumps(specials, indent=2, ensure_ascii=False),
                                                      encoding="utf-8")
        return root

    def gguf_fields(self, pre: str | None = None) -> dict[str, Any]:
        """This tokenizer as GGUF `tokenizer.*` metadata (byte-level BPE only), for `write_gguf`.

        pre: llama.cpp pre-tokenizer kind to record ("smollm", "qwen2", "llama-bpe", "gpt2"); by default the one
        the tokenizer came with, or the one whose split matches its pre-tokenizer.
        """
        spec = json.loads(self.backend.to_str())
        if spec["model"]["type"] != "BPE":
            raise ValueError("Only BPE tokenizers can be written to GGUF metadata.")
        pre = pre or self.gguf_pre or _infer_gguf_pre(self.backend)
        n = self.vocab_size
        tokens = [self.backend.id_to_token(i) for i in range(n)]
        if any(t is None for t in tokens):
            raise ValueError("Vocabulary ids are not contiguous; GGUF needs one token per id.")
        added = {a["id"]: a for a in spec.get("added_tokens", [])}
        types = [(_TT_CONTROL if added[i]["special"] else _TT_USER_DEFINED) if i in added else _TT_NORMAL
                 for i in range(n)]
        merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
        fields: dict[str, Any] = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.add_bos_token": False,
        }
        for key, tok in (("bos_token_id", self.bos_token), ("eos_token_id", self.eos_token),
                         ("padding_token_id", self.pad_token), ("unknown_token_id", self.unk_token)):
            if tok is not None:
                fields[f"tokenizer.ggml.{key}"] = self.backend.token_to_id(tok)
        if self.chat_template is not None:
            fields["tokenizer.chat_template"] = self.chat_template
        return fields


def _split_spec(backend: _Backend) -> str:
    """The normalizer + pre-tokenizer of a backend as JSON, minus settings that do not change ids."""
    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "trim_offsets"}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x

    spec = json.loads(backend.to_str())
    return json.dumps(strip([spec.get("normalizer"), spec.get("pre_tokenizer")]), sort_keys=True)


def _infer_gguf_pre(backend: _Backend) -> str:
    """The llama.cpp pre-tokenizer kind whose split this backend uses; raises if none matches."""
    target = _split_spec(backend)
    for kind in ("gpt2", "smollm", "qwen2", "llama-bpe"):
        probe = _Backend(models.BPE({}, []))
        byte_level_pipeline(probe, kind)
        if _split_spec(probe) == target:
            return kind
    raise ValueError("This tokenizer's pre-tokenizer matches no known llama.cpp kind; pass gguf_fields(pre=...).")


# ----------------------------------------------------------------------------------- chat templates

def _compile_template(source: str):
    """Compile a chat template in the sandboxed environment transformers uses (same filters/globals)."""
    import jinja2  # noqa: PLC0415
    from jinja2.ext import Extension, loopcontrols  # noqa: PLC0415
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

    class _Generation(Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant spans for masks; rendering ignores it.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain json.dumps.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
