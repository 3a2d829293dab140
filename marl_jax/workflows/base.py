"""Workflow building blocks: records, prompt templates, token splicing and the Workflow interface.

A workflow is static dataflow. It names its roles and, before any sampling, a fixed list of stages;
each stage runs one role with a fixed maximum fan-out per episode. The rollout engine
(marl_jax.workflows.rollout) executes a stage by asking every episode of the batch for its requests,
sending all of them to the sampler in ONE call, and handing each episode its new rows; the workflow's
text glue (verdicts, selections, item parsing) runs on the host between stages.

Token in, token out
-------------------
Every call becomes a Row with the exact prompt tokens and the exact sampled completion tokens and
log-probs. When a later prompt quotes an earlier output verbatim, the earlier completion TOKENS are
spliced in rather than its decoded text re-encoded: the chat template is rendered with a unique
placeholder string for each quoted output, the rendered text is split on the placeholders, the text
pieces are encoded, and the completion token lists (minus a trailing stop token) go in between. So a
later role sees exactly the tokens the earlier role produced (non-canonical tokenisations included),
and no completion that is trained on is ever re-tokenised. Text that is not a whole output (the
problem statement, template text, an item parsed out of an orchestrator's output) is encoded as text.

Tokenizer contract used here: ``encode(text)`` adds no BOS/EOS but maps special-token strings in the
text (``<|im_start|>`` ...) to their ids, as Hugging Face fast tokenizers do with
``add_special_tokens=False``; ``apply_chat_template(messages, add_generation_prompt=True,
enable_thinking=False)`` returns the rendered prompt string.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import json
import os
import re
import secrets
from typing import Any, Callable, ClassVar, Mapping, NamedTuple, Protocol, Sequence, Union

from marl_jax.tasks.base import Score, Task

__all__ = [
    "Completion",
    "Sampler",
    "Tokenizer",
    "Row",
    "Episode",
    "TranscriptEntry",
    "Stage",
    "Splice",
    "Part",
    "Message",
    "Request",
    "EpisodeState",
    "Workflow",
    "fill",
    "render_prompt",
    "load_prompts",
    "PROMPT_DIR",
]


class Completion(NamedTuple):
    """One sampled completion.

    tokens: sampled tokens, including the stop token when one was hit; logprobs: the sampling
    log-prob of each token (same length); finished: True when a stop token ended the completion
    (then tokens[-1] is that stop token), False when it ran out of max_new_tokens.
    """

    tokens: list[int]
    logprobs: list[float]
    finished: bool


# sample(slot, prompts, max_new_tokens, stage) -> one Completion per prompt, in order. One call is one
# batched call of the jitted sampler; stage names the call for logging and PRNG keying.
Sampler = Callable[[int, list[list[int]], int, str], Sequence[Completion]]


class Tokenizer(Protocol):
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            enable_thinking: bool = False) -> str: ...


@dataclasses.dataclass
class Row:
    """One LLM call = one training row.

    call_index: index of this call among the same role's calls in its episode (voter k, turn k,
    worker k). reward and group_key are set by credit assignment; trained=False marks a row that
    credit gives no learning signal (its reward is 0 and so is its whole group's). text is the
    decoded completion (special tokens skipped); prompt_text is the rendered prompt with quoted
    outputs shown as text; info holds what the host parsed from this output (verdict, selection,
    items); score is set for rows whose output was graded.
    """

    prompt_tokens: list[int]
    completion_tokens: list[int]
    logprobs: list[float]
    role: str
    slot: int
    task_id: str
    episode_id: int
    episode_index: int
    call_index: int
    stage: str
    finished: bool
    text: str
    prompt_text: str = ""
    info: dict = dataclasses.field(default_factory=dict)
    score: Score | None = None
    reward: float = 0.0
    trained: bool = True
    group_key: tuple = ()

    @property
    def correct(self) -> bool | None:
        """Whether this row's own output was graded correct (None if it was not graded)."""
        return None if self.score is None else self.score.reward > 0.5


class TranscriptEntry(NamedTuple):
    role: str
    prompt_text: str
    output_text: str
    info: dict
    stage: str
    call_index: int
    reward: float
    group_key: tuple


@dataclasses.dataclass
class Episode:
    """One run of a workflow on one task.

    outcomes: per-role details for inspection (e.g. voting: each generator's correctness, the pick
    and whether it was right); outcomes["role_correct"] maps role -> one 0/1 per call, the per-role
    accuracy the metrics average. metrics: numeric per-episode values averaged over the batch.
    """

    task: Task
    episode_id: int
    episode_index: int
    rows: list[Row]
    final_text: str
    score: Score
    final_row_index: int
    outcomes: dict
    metrics: dict

    @property
    def success(self) -> float:
        return float(self.score.reward)

    @property
    def transcript(self) -> list[TranscriptEntry]:
        return [TranscriptEntry(r.role, r.prompt_text, r.text, r.info, r.stage, r.call_index,
                                r.reward, r.group_key) for r in self.rows]


class Stage(NamedTuple):
    """A step of a workflow: one role, at most max_calls calls per episode, one sampler call."""

    name: str
    role: str
    max_calls: int


@dataclasses.dataclass(frozen=True)
class Splice:
    """An earlier completion quoted verbatim in a later prompt: its tokens and its text."""

    tokens: tuple[int, ...]
    text: str

    @classmethod
    def of(cls, row: Row) -> "Splice":
        """The row's completion tokens without the trailing stop token (present iff finished)."""
        toks = row.completion_tokens[:-1] if row.finished else row.completion_tokens
        return cls(tuple(toks), row.text)


Part = Union[str, Splice]
Message = tuple  # (chat role, tuple[Part, ...])


class Request(NamedTuple):
    """One call an episode wants in the current stage: chat messages and info stored on its row."""

    messages: tuple
    info: dict


# ---------------------------------------------------------------------------------------------
# Prompt templates
# ---------------------------------------------------------------------------------------------

PROMPT_DIR = os.path.join(os.path.dirname(__file__), "prompts")
_FIELD_RE = re.compile(r"\{\{(\w+)\}\}")


@functools.lru_cache(maxsize=None)
def _load_prompt_file(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def resolve_prompt_dir(prompt_dir: str | None) -> str:
    """A folder path, or the name of a packaged set (a subfolder of PROMPT_DIR, e.g. "compact")."""
    if not prompt_dir:
        return PROMPT_DIR
    packaged = os.path.join(PROMPT_DIR, prompt_dir)
    if not os.path.isdir(prompt_dir) and os.sep not in prompt_dir and os.path.isdir(packaged):
        return packaged
    if not os.path.isdir(prompt_dir):
        sets = sorted(d for d in os.listdir(PROMPT_DIR) if os.path.isdir(os.path.join(PROMPT_DIR, d)))
        raise FileNotFoundError(f"prompt_dir {prompt_dir!r} is neither a folder nor a packaged prompt set {sets}")
    return prompt_dir


def load_prompts(kind: str, prompt_dir: str | None = None) -> dict:
    """The prompt templates for one task kind: ``<prompt_dir>/<kind>.json`` (default: packaged).

    prompt_dir may also name a packaged set, e.g. "compact" (short prompts for small models)."""
    prompt_dir = resolve_prompt_dir(prompt_dir)
    path = os.path.join(prompt_dir, f"{kind}.json")
    if not os.path.exists(path):
        have = sorted(f[:-5] for f in os.listdir(prompt_dir) if f.endswith(".json"))
        raise FileNotFoundError(f"no prompt file for task kind {kind!r} at {path}; kinds with "
                                f"prompts: {have}")
    return _load_prompt_file(os.path.abspath(path))


def fill(template: str, **fields: Any) -> list[Part]:
    """Substitute ``{{name}}`` fields of a template; returns text and Splice parts in order.

    A field value is text (or a number), a Splice, or a sequence of parts. Single braces are left
    alone, so templates can say ``\\boxed{}`` freely.
    """
    out: list[Part] = []
    pos = 0
    for m in _FIELD_RE.finditer(template):
        out.append(template[pos:m.start()])
        name = m.group(1)
        if name not in fields:
            raise KeyError(f"prompt template needs field {{{{{name}}}}}; given: {sorted(fields)}")
        value = fields[name]
        if isinstance(value, (str, Splice)):
            out.append(value)
        elif isinstance(value, (int, float)):
            out.append(str(value))
        else:
            out.extend(value)
        pos = m.end()
    out.append(template[pos:])
    return [p for p in out if not (isinstance(p, str) and p == "")]


def render_prompt(tokenizer: Tokenizer, messages: Sequence[Message]) -> tuple[list[int], str]:
    """Chat-render messages and return (prompt tokens, prompt text), splicing Splice parts as tokens.

    Each Splice becomes a unique placeholder for rendering; the rendered string is split on the
    placeholders, text pieces are encoded and the Splice tokens inserted between them. The text
    returned shows each Splice as its text.
    """
    splices: list[Splice] = []
    texts = [p for _, parts in messages for p in parts if isinstance(p, str)]
    nonce = secrets.token_hex(6)
    while any(nonce in t for t in texts):
        nonce = secrets.token_hex(6)
    chat = []
    for role, parts in messages:
        content = []
        for p in parts:
            if isinstance(p, Splice):
                content.append(f"XSPLICE{nonce}N{len(splices)}X")
                splices.append(p)
            else:
                content.append(p)
        chat.append({"role": role, "content": "".join(content)})
    rendered = tokenizer.apply_chat_template(chat, add_generation_prompt=True,
                                             enable_thinking=False)
    pieces = re.split(f"XSPLICE{nonce}N(\\d+)X", rendered)
    # pieces alternates text, index, text, ...: every placeholder must survive once, in order.
    found = [int(i) for i in pieces[1::2]]
    if found != list(range(len(splices))):
        raise RuntimeError(
            f"the chat template dropped, duplicated or reordered quoted outputs (placeholders found "
            f"{found}, expected {list(range(len(splices)))}); token splicing needs a template that "
            "copies message content verbatim")
    tokens: list[int] = []
    text_parts: list[str] = []
    for j, piece in enumerate(pieces):
        if j % 2 == 0:
            if piece:
                tokens.extend(tokenizer.encode(piece))
                text_parts.append(piece)
        else:
            s = splices[int(piece)]
            tokens.extend(s.tokens)
            text_parts.append(s.text)
    return tokens, "".join(text_parts)


# ---------------------------------------------------------------------------------------------
# Workflow interface
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class EpisodeState:
    """An episode while it runs: its rows so far and the workflow's parsed state."""

    task: Task
    episode_id: int
    episode_index: int
    rows: list[Row] = dataclasses.field(default_factory=list)
    state: dict = dataclasses.field(default_factory=dict)

    def rows_of(self, role: str) -> list[Row]:
        return [r for r in self.rows if r.role == role]


@dataclasses.dataclass(frozen=True)
class Workflow(abc.ABC):
    """Base of the four workflows. Subclasses are frozen dataclasses whose fields are the config.

    prompt_dir: folder with ``math.json`` / ``code.json`` templates replacing the packaged ones.
    group_by_call_index: None uses the workflow's default (see default_group_by_call_index).
    """

    prompt_dir: str | None = None
    group_by_call_index: bool | None = None

    name: ClassVar[str] = ""
    roles: ClassVar[tuple[str, ...]] = ()

    # --- dataflow ---------------------------------------------------------------------------
    @abc.abstractmethod
    def plan(self, tasks: Sequence[Task]) -> tuple[Stage, ...]:
        """The fixed list of stages for a batch of these tasks (known before sampling)."""

    @abc.abstractmethod
    def requests(self, stage: Stage, ep: EpisodeState) -> list[Request]:
        """The calls this episode makes in this stage (empty: the episode sits the stage out)."""

    def consume(self, stage: Stage, ep: EpisodeState, rows: list[Row]) -> None:
        """Parse this stage's outputs of one episode into ep.state / row.info (host glue)."""

    # --- outcome ----------------------------------------------------------------------------
    @abc.abstractmethod
    def graded_rows(self, ep: EpisodeState) -> list[Row]:
        """Rows whose output is a candidate answer to grade (always includes the final row)."""

    @abc.abstractmethod
    def final_row(self, ep: EpisodeState) -> Row:
        """The row whose output is the episode's final answer."""

    @abc.abstractmethod
    def per_agent_rewards(self, ep: EpisodeState, final: Score) -> list[float | None]:
        """Per-agent credit, one entry per ep.rows; None = no learning signal for that row."""

    @abc.abstractmethod
    def outcomes(self, ep: EpisodeState, final: Score) -> tuple[dict, dict]:
        """(details incl. "role_correct", numeric per-episode metrics) after grading."""

    def default_group_by_call_index(self, kind: str) -> bool:
        """Whether GRPO groups split repeated calls of a role by call index, by default."""
        return False

    def groups_by_call_index(self, kind: str) -> bool:
        if self.group_by_call_index is not None:
            return bool(self.group_by_call_index)
        return self.default_group_by_call_index(kind)

    # --- prompt helpers ---------------------------------------------------------------------
    def _spec(self, kind: str, path: Sequence[str]) -> Any:
        node: Any = load_prompts(kind, self.prompt_dir)
        for i, key in enumerate(path):
            if not isinstance(node, Mapping) or key not in node:
                raise KeyError(f"prompt file for {kind!r} has no entry {'.'.join(path[:i + 1])}")
            node = node[key]
        return node

    def chat(self, ep: EpisodeState, *path: str, **fields: Any) -> tuple:
        """System + user messages from the template at path (a {"system", "user"} entry)."""
        spec = self._spec(ep.task.kind, path)
        if not isinstance(spec, Mapping) or "user" not in spec:
            raise ValueError(f"prompt entry {'.'.join(path)} must be an object with a 'user' "
                             "template (and optionally 'system')")
        msgs = []
        if spec.get("system"):
            msgs.append(("system", tuple(fill(spec["system"], **fields))))
        msgs.append(("user", tuple(fill(spec["user"], **fields))))
        return tuple(msgs)

    def fragment(self, ep: EpisodeState, *path: str, **fields: Any) -> list[Part]:
        """A template fragment (a string entry) filled with fields."""
        spec = self._spec(ep.task.kind, path)
        if not isinstance(spec, str):
            raise ValueError(f"prompt entry {'.'.join(path)} must be a string template")
        return fill(spec, **fields)

    @classmethod
    def config_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))


def parallel_copies(workflow) -> dict[str, int]:
    """Roles called several times in parallel on one episode (for copy-alignment diagnostics)."""
    if hasattr(workflow, "n_votes"):
        return {"generator": int(workflow.n_votes)}
    if hasattr(workflow, "max_items"):
        return {"worker": int(workflow.max_items)}
    return {}
