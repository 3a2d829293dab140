"""Math tasks: answer extraction, equivalence, the 0/1 reward, and task sources.

Reward rule (as in the reference system): take the final answer of the output (by default the
content of the last ``\\boxed{...}``), compare it with the ground truth by normalised string match,
then by symbolic/numeric equivalence with math-verify; 1.0 on a match, 0.0 otherwise, and 0.0 when no
answer can be extracted. A lenient last-number mode exists for small models that rarely box.
"""
from __future__ import annotations

import ast
import functools
import json
import logging
import operator
import os
import re
import threading
from fractions import Fraction
from typing import Any, Iterable, Mapping

from etils import epath

from marl_jax.tasks.base import Score, Task
from marl_jax.tasks.data import MissingKeyError, TaskFileError, decode_utf8, read_jsonl

__all__ = [
    "EXTRACTION_MODES",
    "REASONING_GYM_TASKS",
    "extract_boxed",
    "extract_last_number",
    "extract_answer",
    "normalize_answer",
    "is_equivalent",
    "score",
    "reasoning_gym_tasks",
    "load_math_file",
]

EXTRACTION_MODES = ("boxed", "last_number", "boxed_or_last_number")

# math-verify is never handed more than this; longer "answers" are garbage and could stall sympy
# where no timeout is available (worker threads).
MAX_VERIFY_CHARS = 1000
# Seconds per math-verify parse/compare; only enforced in the main thread (signal.alarm).
VERIFY_TIMEOUT_S = 5

_log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def match_braces(text: str, open_idx: int) -> int | None:
    """Index of the '}' closing the '{' at open_idx, or None if unbalanced.

    Escaped braces (``\\{``, ``\\}``) are literal characters in TeX, not groups, so they are skipped.
    """
    depth = 0
    i = open_idx
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return None


def _box_content(text: str, end: int) -> str | None:
    """Content of the box whose command ends at index end ("" if empty); None if it is unclosed."""
    rest = text[end:]
    stripped = rest.lstrip()
    if stripped.startswith("{"):
        open_idx = end + (len(rest) - len(stripped))
        close_idx = match_braces(text, open_idx)
        return None if close_idx is None else text[open_idx + 1 : close_idx].strip()
    if rest[:1].isspace():  # brace-less "\boxed 5"
        m = re.match(r"[^\s$]+", stripped)
        return m.group(0) if m else ""
    return ""


def extract_boxed(text: str) -> str | None:
    """Content of the last non-empty ``\\boxed{...}`` / ``\\fbox{...}`` in text, or None.

    Nested braces are matched. The brace-less form ``\\boxed 5`` yields the text after the space up to
    the next whitespace or ``$``. Empty boxes are skipped (small models echo the instruction "put
    your answer in \\boxed{}"). If the last box is unclosed (e.g. a truncated output), the result is
    None: an earlier box is an intermediate result, not the final answer.
    """
    for match in reversed(list(_BOX_RE.finditer(text or ""))):
        content = _box_content(text, match.end())
        if content is None or content:
            return content
    return None


# A number: optional sign (attached to the digits and not right after a word character or closing
# bracket, where it is a binary minus: "5-3", "5 - 3"), digits with optional thousands commas,
# optional decimals, optional "/denominator" for plain fractions. Signs include the Unicode minus.
_NUM_RE = re.compile(
    r"(?<![\w.)\]}])(?P<sign>[-+\u2212])?"
    r"(?P<int>\d{1,3}(?:,\d{3})+(?!\d)|\d+)?(?P<dec>\.\d+)?"
    r"(?:/(?P<den>\d+)(?![\d.]))?"
)
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")


def extract_last_number(text: str) -> str | None:
    """The last integer, decimal or fraction in text, canonicalised; None if there is none.

    Lenient mode for small models that rarely box: "1,234" -> "1234", "+5" -> "5", "−3" -> "-3",
    "3/4" stays "3/4", ``\\frac{3}{4}`` -> "3/4". A minus right after a digit or letter ("5-3") or
    followed by a space ("5 - 3") is read as subtraction, not as the sign of the next number.
    """
    if not text:
        return None
    text = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    last = None
    for m in _NUM_RE.finditer(text):
        if m.group("int") is None and m.group("dec") is None:
            continue
        # "5.3.2"-style tails and words like "v2" are excluded by the lookbehind; a decimal part
        # without an integer part (".5") is accepted.
        last = m
    if last is None:
        return None
    sign = "-" if last.group("sign") in ("-", "\u2212") else ""
    number = (last.group("int") or "0").replace(",", "") + (last.group("dec") or "")
    if last.group("den") is not None:
        number += "/" + last.group("den")
    return sign + number


def extract_answer(text: str, mode: str = "boxed") -> str | None:
    """Final answer of text by mode: "boxed", "last_number" or "boxed_or_last_number"."""
    if mode == "boxed":
        return extract_boxed(text)
    if mode == "last_number":
        return extract_last_number(text)
    if mode == "boxed_or_last_number":
        boxed = extract_boxed(text)
        return boxed if boxed is not None else extract_last_number(text)
    raise ValueError(f"unknown extraction mode {mode!r}; use one of {EXTRACTION_MODES}")


# ---------------------------------------------------------------------------------------------
# Normalisation and equivalence
# ---------------------------------------------------------------------------------------------

_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])|~")
_THOUSANDS = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_DECIMAL = re.compile(r"^[-+]?\d+\.\d+$")


def normalize_answer(s: Any) -> str:
    """A canonical string form of an answer, for the fast exact-match path.

    Only rewrites that keep the mathematical value are applied, so equal normal forms mean equal
    answers; anything subtler is left to math-verify. In order: math delimiters (``$``, ``\\(``,
    ``\\)``, ``\\[``, ``\\]``) removed; ``\\left`` / ``\\right`` and TeX spacing (``\\,``, ``\\;``,
    ``\\!``, ``~``, ``\\quad``) removed; ``\\dfrac`` / ``\\tfrac`` -> ``\\frac``; ``\\text{..}``-style
    wrappers unwrapped; degree marks (``^\\circ``, ``^{\\circ}``, ``°``) removed; all whitespace
    removed; ``{,}`` -> ``,``; a trailing period removed; then, for a plain number, thousands commas
    dropped, a leading "+" dropped and trailing decimal zeros trimmed ("2.50" -> "2.5", "3.0" -> "3").
    Words such as units are kept: "5 apples" is not reduced to "5" here.
    """
    s = str(s).strip()
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = s.replace("\\left", "").replace("\\right", "")
    s = _SPACING.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    prev = None
    while prev != s:  # unwrap nested \text{\textbf{..}}
        prev = s
        s = _TEXT_WRAPPERS.sub(r"\1", s)
    s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\u00b0", "")
    s = re.sub(r"\s+", "", s)
    s = s.replace("{,}", ",")  # MATH's TeX thousands separator: 1{,}250
    s = s.rstrip(".")
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    if re.match(r"^\+\d", s):
        s = s[1:]
    if _DECIMAL.match(s):
        s = s.rstrip("0").rstrip(".")
    if s in ("-0", "0.0"):
        s = "0"
    return s


def _timeouts_usable() -> bool:
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    return threading.current_thread() is threading.main_thread()


@functools.lru_cache(maxsize=4096)
def _parse(answer: str, with_timeout: bool) -> tuple:
    """math-verify's parse of an answer presented as a boxed expression (cached: gold repeats)."""
    from math_verify import parse  # imported lazily: it pulls in sympy

    timeout = VERIFY_TIMEOUT_S if with_timeout else None
    try:
        return tuple(parse("\\boxed{" + answer + "}", parsing_timeout=timeout))
    except Exception:  # noqa: BLE001 - a parse failure means "not verifiable", never a crash
        _log.debug("math-verify could not parse %r", answer, exc_info=True)
        return ()


def is_equivalent(pred: Any, truth: Any) -> bool:
    """Whether pred denotes the same answer as truth.

    Normalised string match first (see normalize_answer), then math-verify's symbolic/numeric check
    (``verify(parse(truth), parse(pred))``, truth as gold). Safe from any thread: outside the main
    thread math-verify runs without its signal-based timeout, and inputs longer than
    MAX_VERIFY_CHARS are not handed to it at all. In the main thread that timeout uses SIGALRM and
    cancels any alarm the caller has pending.
    """
    if pred is None or truth is None:
        return False
    pred, truth = str(pred).strip(), str(truth).strip()
    if not pred or not truth:
        return False
    npred, ntruth = normalize_answer(pred), normalize_answer(truth)
    if npred and npred == ntruth:
        return True
    if len(pred) > MAX_VERIFY_CHARS or len(truth) > MAX_VERIFY_CHARS:
        return False
    from math_verify import verify

    with_timeout = _timeouts_usable()
    gold, target = _parse(truth, with_timeout), _parse(pred, with_timeout)
    if not gold or not target:
        return False
    try:
        return bool(
            verify(list(gold), list(target), timeout_seconds=VERIFY_TIMEOUT_S if with_timeout else None)
        )
    except Exception:  # noqa: BLE001 - comparison errors count as "not equal"
        _log.debug("math-verify failed on %r vs %r", pred, truth, exc_info=True)
        return False


def score(text: str, answer: Any, mode: str = "boxed") -> Score:
    """The 0/1 reward of an output against the ground-truth answer.

    extracted holds the extracted final answer (None if none was found, which scores 0).
    """
    extracted = extract_answer(text or "", mode)
    if extracted is None:
        return Score(reward=0.0, extracted=None, info=f"no answer found ({mode})")
    ok = is_equivalent(extracted, answer)
    return Score(reward=1.0 if ok else 0.0, extracted=extracted, info="correct" if ok else "wrong")


# ---------------------------------------------------------------------------------------------
# Task sources
# ---------------------------------------------------------------------------------------------

# reasoning-gym datasets whose answer is a single number or fraction that the checker above grades.
REASONING_GYM_TASKS = (
    "basic_arithmetic",
    "chain_sum",
    "gsm_symbolic",
    "products",
    "simple_equations",
    "leg_counting",
    "gcd",
    "lcm",
    "count_bits",
    "fraction_simplification",
)


_EXACT_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _exact_value(expr: str) -> Fraction | None:
    """Exact rational value of an integer arithmetic expression (+ - * / and parentheses), or None."""

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _EXACT_OPS:
            return _EXACT_OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"unsupported syntax {ast.dump(node)}")

    try:
        return ev(ast.parse(expr, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None


def _answer_is_exact(entry: Mapping[str, Any]) -> bool:
    """Whether the stated answer is the exact value of the shown expression.

    reasoning-gym's basic_arithmetic evaluates "/" as floor division, which gives a wrong answer
    for the few expressions whose division is not exact (about 1% with the default settings), and
    with allow_parentheses=False it shows a different divisor from the one it used (about 20% of
    tasks with "/"). Such items are skipped.
    """
    value = _exact_value(entry["metadata"].get("expression", ""))
    try:
        return value is not None and value == Fraction(str(entry["answer"]).strip())
    except ValueError:
        return False


def reasoning_gym_tasks(name: str, n: int, seed: int, **difficulty: Any) -> list[Task]:
    """n math tasks generated offline by reasoning-gym's dataset `name`.

    difficulty is passed to the dataset's config, e.g. basic_arithmetic / chain_sum take
    min_terms, max_terms, min_digits, max_digits; basic_arithmetic also operators,
    allow_parentheses, allow_negation (with allow_parentheses=False reasoning-gym draws constants
    from 0..10**digits inclusive, so "1 digit" can show a 10). For basic_arithmetic and chain_sum,
    items whose answer is not the exact value of their expression are skipped (see _answer_is_exact),
    so task ids carry reasoning-gym's item index. The same (name, seed, difficulty) gives the same
    tasks, and the first k of n tasks equal the tasks for n=k.
    """
    if name not in REASONING_GYM_TASKS:
        raise ValueError(
            f"unknown reasoning-gym math task {name!r}; valid names: {list(REASONING_GYM_TASKS)}"
        )
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    if not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    import dataclasses

    import reasoning_gym
    from reasoning_gym.factory import DATASETS

    _, config_cls = DATASETS[name]
    fields = {f.name for f in dataclasses.fields(config_cls)} - {"seed", "size"}
    unknown = sorted(set(difficulty) - fields)
    if unknown:
        raise TypeError(
            f"reasoning-gym {name!r} has no setting(s) {unknown}; valid settings: {sorted(fields)}"
        )
    checked = name in ("basic_arithmetic", "chain_sum")
    # Items depend only on (seed, index), so a larger virtual size leaves room to skip bad items.
    size = 2 * n + 64 if checked else n
    try:
        dataset = reasoning_gym.create_dataset(name, seed=seed, size=size, **difficulty)
    except AssertionError as e:  # reasoning-gym validates configs with assert
        raise ValueError(f"invalid reasoning-gym {name!r} settings {difficulty}: {e}") from None
    tasks = []
    for i in range(size):
        if len(tasks) == n:
            break
        entry = dataset[i]
        if checked and not _answer_is_exact(entry):
            continue
        answer = str(entry["answer"]).strip().strip("$").strip()
        tasks.append(
            Task(
                task_id=f"rg/{name}/{seed}/{i}",
                kind="math",
                question=entry["question"],
                answer=answer,
                meta={
                    "source": f"reasoning_gym/{name}",
                    "seed": seed,
                    "index": i,
                    "metadata": entry["metadata"],
                },
            )
        )
    if len(tasks) < n:
        raise ValueError(
            f"reasoning-gym {name!r} with {difficulty} gave only {len(tasks)} tasks with exact answers "
            f"among {size} items; change the settings (e.g. drop '/' from operators)"
        )
    return tasks


def _read_rows(path: str) -> Iterable[Mapping[str, Any]]:
    """Rows of a .jsonl, .json (a list of objects) or .parquet file; a .jsonl's come as (line, row) pairs."""
    lower = path.lower()
    if lower.endswith(".jsonl"):
        return read_jsonl(path)
    if lower.endswith(".json"):
        with epath.Path(path).open("rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lineno = raw[: e.start].count(b"\n") + 1
            decode_utf8(raw.splitlines()[lineno - 1], path, lineno)  # raises, naming the line
            raise
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise TaskFileError(f"{path}: line {e.lineno} is not valid JSON ({e.msg} at column {e.colno}); "
                                "fix it, or write one object per line as .jsonl") from None
        if not isinstance(data, list):
            raise ValueError(
                f"{path}: a .json file must hold a list of objects; use .jsonl for one object per line"
            )
        return data
    if lower.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
        with epath.Path(path).open("rb") as f:
            return pq.read_table(f).to_pylist()
    raise ValueError(f"{path}: unsupported file type; use .jsonl, .json or .parquet")


def _get(row: Mapping[str, Any], key: str, what: str, where: str, path: str) -> Any:
    """row[key], where a dotted key ("reward_model.ground_truth") walks nested objects."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            keys = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            raise MissingKeyError(
                f"{path}: {where} has no {what} key {key!r} (missing {part!r}; available: {keys}); "
                f"name the right field with --config.task.{what}_key=... ({what}_key=... to load_math_file), "
                "or fix that row"
            )
        value = value[part]
    return value


def _question_text(value: Any, where: str, path: str) -> str:
    # Chat-style prompts (DAPO-Math parquet): a list of {"role", "content"}; use the last user turn.
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, Mapping) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if not users or not isinstance(users[-1], str):
            raise TaskFileError(f"{path}: {where}: question is a message list without a user message")
        return users[-1]
    if not isinstance(value, str):
        raise TaskFileError(
            f"{path}: {where}: question must be a string or a chat message list, "
            f"got {type(value).__name__}"
        )
    if not value.strip():
        raise TaskFileError(f"{path}: {where}: empty question; fill it in or delete that row")
    return value


def _ground_truth(value: Any, where: str, path: str) -> str:
    # GSM8K: reasoning then "#### 42"; MATH: a full solution with \boxed{..}; else the answer itself.
    if isinstance(value, (list, tuple)) and len(value) == 1:
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TaskFileError(
            f"{path}: {where}: answer must be a string or number, got {type(value).__name__}; fix that row"
        )
    text = str(value).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    elif _BOX_RE.search(text):
        boxed = extract_boxed(text)
        if boxed is None:
            raise TaskFileError(
                f"{path}: {where}: answer has a \\boxed but no complete, non-empty one: {text[-80:]!r}; fix that row"
            )
        text = boxed
    if not text:
        raise TaskFileError(f"{path}: {where}: empty answer; give the row its reference answer or delete it "
                            "(a task without one can never be graded correct)")
    return text


def load_math_file(
    path: str | os.PathLike,
    question_key: str = "problem",
    answer_key: str = "answer",
    id_key: str | None = None,
    limit: int | None = None,
) -> list[Task]:
    """Math tasks from a DAPO-Math / GSM8K / MATH style .jsonl, .json or .parquet file.

    Keys may be dotted to reach nested fields (DAPO-Math: question_key="prompt",
    answer_key="reward_model.ground_truth"). A question given as a chat message list uses its last
    user message. Answers ending in "#### x" (GSM8K) become x; answers holding a \\boxed{x} (MATH
    solutions) become x. Task ids come from id_key, else "<file stem>/<row>". limit keeps the first
    limit rows.
    """
    path = os.fspath(path)
    if not epath.Path(path).is_file():  # local, or a URI (gs://...) read through etils.epath
        raise FileNotFoundError(f"math data file not found: {path}")
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit must be a positive int or None, got {limit!r}")
    stem = os.path.splitext(os.path.basename(path))[0]
    tasks: list[Task] = []
    seen: set[str] = set()
    for rowno, item in enumerate(_read_rows(path)):
        if limit is not None and rowno >= limit:
            break
        lineno, row = item if isinstance(item, tuple) else (None, item)
        where = f"row {rowno}" if lineno is None else f"line {lineno}, row {rowno}"
        if not isinstance(row, Mapping):
            raise TaskFileError(f"{path}: {where} is a {type(row).__name__}, expected an object")
        question = _question_text(_get(row, question_key, "question", where, path), where, path)
        answer = _ground_truth(_get(row, answer_key, "answer", where, path), where, path)
        task_id = str(_get(row, id_key, "id", where, path)) if id_key else f"{stem}/{rowno}"
        if task_id in seen:
            raise TaskFileError(f"{path}: {where}: duplicate task id {task_id!r} (from id_key={id_key!r})")
        seen.add(task_id)
        meta = {"source": path, "row": rowno}
        tasks.append(Task(task_id=task_id, kind="math", question=question, answer=answer, meta=meta))
    if not tasks:
        raise ValueError(f"{path}: no rows read")
    return tasks
