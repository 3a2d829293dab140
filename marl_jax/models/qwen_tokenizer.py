"""The real Qwen2/Qwen3 tokenizer, rebuilt offline from the `qwen.tiktoken` BPE ranks some PyPI wheels ship.

Qwen2 and Qwen3 share Qwen's 151,643 byte-level BPE ranks (the file `qwen.tiktoken` inside the `dashscope`
and `qwen-agent` wheels) and add special tokens from id 151643 on. This module converts the ranks to a
`tokenizers` BPE (vocabulary + merges, the standard tiktoken conversion), sets Qwen2's pre-tokenizer (NFC,
its split regex, byte-level), adds Qwen3's special tokens and chat template, and can save the result as a
Hugging Face tokenizer folder. It is a stand-in for a Qwen3 checkpoint's tokenizer where no hub is reachable.
"""
from __future__ import annotations

import base64
import importlib.util
import os
import pathlib

from tokenizers import AddedToken, models
from tokenizers import Tokenizer as _Backend

from marl_jax.models.tokenizer import Tokenizer, bytes_to_unicode, byte_level_pipeline

# (package, file inside it) that carry the ranks; located as package data, never imported.
_TIKTOKEN_SOURCES = (("dashscope", "resources/qwen.tiktoken"), ("qwen_agent", "utils/qwen.tiktoken"))
QWEN_BPE_SIZE = 151643

# Qwen3's added tokens from id 151643 on: (text, special). Non-special ones are matched whole but kept on decode.
QWEN3_ADDED_TOKENS = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
)

# Qwen3's (hybrid thinking) chat template, as in the Qwen3 checkpoints' tokenizer_config.json.
QWEN3_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}\n"
    "{%- for message in messages[::-1] %}\n"
    "    {%- set index = (messages|length - 1) - loop.index0 %}\n"
    "    {%- if ns.multi_step_tool and message.role == \"user\" and message.content is string and "
    "not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}\n"
    "        {%- set ns.multi_step_tool = false %}\n"
    "        {%- set ns.last_query_index = index %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.content is string %}\n"
    "        {%- set content = message.content %}\n"
    "    {%- else %}\n"
    "        {%- set content = '' %}\n"
    "    {%- endif %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {%- set reasoning_content = '' %}\n"
    "        {%- if message.reasoning_content is string %}\n"
    "            {%- set reasoning_content = message.reasoning_content %}\n"
    "        {%- else %}\n"
    "            {%- if '</think>' in content %}\n"
    "                {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1]"
    ".lstrip('\\n') %}\n"
    "                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}\n"
    "            {%- endif %}\n"
    "        {%- endif %}\n"
    "        {%- if loop.index0 > ns.last_query_index %}\n"
    "            {%- if loop.last or (not loop.last and reasoning_content) %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}\n"
    "            {%- else %}\n"
    "                {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "            {%- endif %}\n"
    "        {%- else %}\n"
    "            {{- '<|im_start|>' + message.role + '\\n' + content }}\n"
    "        {%- endif %}\n"
    "        {%- if message.tool_calls %}\n"
    "            {%- for tool_call in message.tool_calls %}\n"
    "                {%- if (loop.first and content) or (not loop.first) %}\n"
    "                    {{- '\\n' }}\n"
    "                {%- endif %}\n"
    "                {%- if tool_call.function %}\n"
    "                    {%- set tool_call = tool_call.function %}\n"
    "                {%- endif %}\n"
    "                {{- '<tool_call>\\n{\"name\": \"' }}\n"
    "                {{- tool_call.name }}\n"
    "                {{- '\", \"arguments\": ' }}\n"
    "                {%- if tool_call.arguments is string %}\n"
    "                    {{- tool_call.arguments }}\n"
    "                {%- else %}\n"
    "                    {{- tool_call.arguments | tojson }}\n"
    "                {%- endif %}\n"
    "                {{- '}\\n</tool_call>' }}\n"
    "            {%- endfor %}\n"
    "        {%- endif %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if loop.first or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}"
)


def find_qwen_tiktoken() -> pathlib.Path:
    """Path of `qwen.tiktoken` from an installed dashscope or qwen-agent wheel (neither is imported)."""
    for package, rel in _TIKTOKEN_SOURCES:
        spec = importlib.util.find_spec(package)
        for folder in (spec.submodule_search_locations or []) if spec else []:
            path = pathlib.Path(folder) / rel
            if path.is_file():
                return path
    raise FileNotFoundError(
        "qwen.tiktoken not found. It ships in the dashscope wheel: pip install --no-deps dashscope "
        "(or: pip install --no-deps qwen-agent)."
    )


def load_tiktoken_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """A tiktoken BPE file (`base64(token) rank` per line) as {token bytes: rank}."""
    ranks = {}
    for line in pathlib.Path(path).read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def tiktoken_to_bpe(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tiktoken ranks -> (byte-level vocabulary, merges) of an equivalent `tokenizers` BPE.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank. Listing, for every token,
    each split into two tokens, ordered by the merged token's rank, reproduces that order as BPE merges.
    """
    spell = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(spell[x] for x in b)

    vocab = {s(tok): rank for tok, rank in ranks.items()}
    merges = []
    for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        splits = [(tok[:i], tok[i:]) for i in range(1, len(tok)) if tok[:i] in ranks and tok[i:] in ranks]
        splits.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges.extend((s(a), s(b)) for a, b in splits)
    return vocab, merges


def qwen3_tokenizer(tiktoken_path: str | os.PathLike | None = None) -> Tokenizer:
    """The Qwen3 tokenizer (151,669 ids incl. added tokens; eos <|im_end|>, pad <|endoftext|>, no bos)."""
    ranks = load_tiktoken_ranks(tiktoken_path or find_qwen_tiktoken())
    if len(ranks) != QWEN_BPE_SIZE or sorted(ranks.values()) != list(range(QWEN_BPE_SIZE)):
        raise ValueError(f"Expected Qwen's {QWEN_BPE_SIZE} contiguous BPE ranks; this file holds {len(ranks)}.")
    vocab, merges = tiktoken_to_bpe(ranks)
    backend = _Backend(models.BPE(vocab, merges, dropout=None, unk_token=None, fuse_unk=False, byte_fallback=False))
    byte_level_pipeline(backend, "qwen2")
    for i, (text, special) in enumerate(QWEN3_ADDED_TOKENS):
        token = AddedToken(text, special=special, normalized=False)
        backend.add_special_tokens([token]) if special else backend.add_tokens([token])
        if backend.token_to_id(text) != QWEN_BPE_SIZE + i:  # ids are positional: guard the order
            raise AssertionError(f"{text} got id {backend.token_to_id(text)}, expected {QWEN_BPE_SIZE + i}.")
    return Tokenizer(backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=QWEN3_CHAT_TEMPLATE,
                     gguf_pre="qwen2")


def qwen3_tokenizer_dir(out_dir: str | os.PathLike, tiktoken_path: str | os.PathLike | None = None) -> pathlib.Path:
    """Write the Qwen3 tokenizer as a Hugging Face folder (tokenizer.json + tokenizer_config.json); returns it."""
    return qwen3_tokenizer(tiktoken_path).save_hf_dir(out_dir)
