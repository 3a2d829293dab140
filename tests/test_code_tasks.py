"""Code rewards: HumanEval canonical solutions (ground truth we did not write) must all
pass; broken variants, hand-checked stdin/stdout and call-based specs, extraction, loaders."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from marl_jax.tasks import code
from marl_jax.tasks.base import Score, Task
from marl_jax.tasks.code import (CodeResult, extract_code, load_code_jsonl, load_humaneval,
                                 normalize_tests, run_tests, score, score_many)

FIXTURE = Path(__file__).parent / "data" / "code_sample.jsonl"


@pytest.fixture(scope="module")
def humaneval() -> dict[str, Task]:
    return {t.task_id: t for t in load_humaneval()}


def _fenced(src: str) -> str:
    return f"Here is my solution.\n```python\n{src}\n```\nDone."


# ------------------------------------------------------------------------------------
# HumanEval
# ------------------------------------------------------------------------------------


def test_humaneval_loader(humaneval):
    assert len(humaneval) == 164
    t = humaneval["HumanEval/0"]
    assert t.kind == "code" and t.question.startswith("from typing import List")
    assert t.answer["entry_point"] == "has_close_elements" == t.meta["entry_point"]
    assert "def check(candidate)" in t.answer["test"]
    assert "return False" in t.meta["canonical_solution"]


def test_all_humaneval_canonical_solutions_get_reward_one(humaneval):
    tasks = list(humaneval.values())
    texts = [_fenced(t.question + t.meta["canonical_solution"]) for t in tasks]
    t0 = time.monotonic()
    scores = score_many(texts, [t.answer for t in tasks], timeout_s=5.0, max_workers=4)
    elapsed = time.monotonic() - t0
    print(f"\n164 HumanEval canonical solutions scored in {elapsed:.1f} s")
    failed = [(t.task_id, s.info) for t, s in zip(tasks, scores) if s.reward != 1.0]
    assert failed == []
    assert all(s.partial == 1.0 and s.extracted for s in scores)
    assert elapsed < 90.0


@pytest.mark.parametrize("task_id, body, kind", [
    ("HumanEval/0", "    return not any(abs(a - b) < threshold for a in numbers for b in numbers)\n",
     "wrong_answer"),
    ("HumanEval/2", "    return number\n", "wrong_answer"),
    ("HumanEval/4", "    while True:\n        pass\n", "timeout"),
    ("HumanEval/7", "    return [s for s in strings if substring in s\n", "syntax_error"),
    ("HumanEval/13", "    raise RuntimeError('boom')\n", "crash"),
    ("HumanEval/23", "    return len(string[1:])\n", "wrong_answer"),
])
def test_broken_humaneval_variants_fail_with_the_right_kind(humaneval, task_id, body, kind):
    t = humaneval[task_id]
    program = t.question + body
    result = run_tests(program, t.answer, timeout_s=1.0)
    assert (result.passed, result.failure, result.tests_passed) == (False, kind, 0)
    s = score(_fenced(program), t.answer, timeout_s=1.0)
    assert s.reward == 0.0 and s.partial == 0.0 and s.info.startswith(kind)


def test_exit_and_forged_results_do_not_pass(humaneval):
    t = humaneval["HumanEval/2"]
    exit_early = t.question + "    return 0.0\nimport sys\nsys.exit(0)\n"
    forge = (t.question + "    return 0.0\nimport os\n"
             "os.write(3, b'{\"ok\": true}\\n')\nos._exit(0)\n")
    for program in (exit_early, forge):
        result = run_tests(program, t.answer)
        assert not result.passed and result.failure == "crash"


def test_main_guard_does_not_run_in_function_tests(humaneval):
    t = humaneval["HumanEval/2"]
    program = (t.question + t.meta["canonical_solution"]
               + "\nif __name__ == '__main__':\n    print(truncate_number(float(input())))\n")
    assert run_tests(program, t.answer).passed


# ------------------------------------------------------------------------------------
# stdin / stdout tests
# ------------------------------------------------------------------------------------

SUM_TESTS = [{"input": "2 3\n", "output": "5\n"},
             {"input": "10 -4\n", "output": "6"},
             {"input": "0 0\n", "output": "0  \n\n\n"}]


def test_stdio_correct_program_passes_with_whitespace_normalised():
    result = run_tests("a, b = map(int, input().split())\nprint(a + b)   \n", SUM_TESTS)
    assert result == CodeResult(True, 3, 3, 3, None, "")


def test_stdio_partial_and_stop_on_first_failure():
    wrong_on_negative = "a, b = map(int, input().split())\nprint(abs(a) + abs(b))\n"
    result = run_tests(wrong_on_negative, SUM_TESTS)
    assert (result.passed, result.tests_passed, result.tests_run) == (False, 2, 3)
    assert result.failure == "wrong_answer" and "test 1" in result.details
    stopped = run_tests(wrong_on_negative, SUM_TESTS, stop_on_first_failure=True)
    assert (stopped.tests_passed, stopped.tests_run, stopped.tests_total) == (1, 2, 3)
    s = score(_fenced(wrong_on_negative), SUM_TESTS)
    assert s.reward == 0.0 and s.partial == pytest.approx(2 / 3)


def test_stdio_failure_kinds(monkeypatch):
    assert run_tests("print(1/0)", SUM_TESTS[:1]).failure == "crash"
    assert run_tests("while True: pass", SUM_TESTS[:1], timeout_s=0.5).failure == "timeout"

    def no_spawning(*args, **kwargs):
        raise AssertionError("a syntax error must be caught before spawning")

    monkeypatch.setattr(code.sandbox, "run_program", no_spawning)
    bad = run_tests("print(1 +)", SUM_TESTS)
    assert (bad.failure, bad.tests_run, bad.tests_total) == ("syntax_error", 0, 3)


def test_stdio_total_time_cap_limits_the_run():
    cases = [{"input": "", "output": "x"}] * 6
    t0 = time.monotonic()
    result = run_tests("while True: pass", cases, timeout_s=0.5, total_timeout_s=1.2)
    # Each timed-out test costs timeout_s plus the sandbox's start-up allowance; the cap must stop
    # well before all six have run (a loose bound: a loaded CI machine is slow to spawn).
    per_test = 0.5 + code.sandbox.SandboxConfig().startup_grace_s
    assert time.monotonic() - t0 < 6 * per_test
    assert result.failure == "timeout" and result.tests_run < 6 and result.tests_passed == 0


def test_stdio_large_expected_output_is_not_cut_short():
    n = 300_000  # about 2 MB of output, more than the default capture cap
    expected = "".join(f"{i}\n" for i in range(n))
    result = run_tests("import sys\nsys.stdout.write(''.join(f'{i}\\n' for i in range(int(input()))))",
                       [{"input": f"{n}\n", "output": expected}])
    assert result.passed, result.details


# ------------------------------------------------------------------------------------
# Function-call tests
# ------------------------------------------------------------------------------------

def test_call_based_tests():
    spec = {"fn_name": "gcd", "inputs": [[12, 18], [7, 5], [0, 9]], "outputs": [6, 1, 9]}
    ok = "def gcd(a, b):\n    while b:\n        a, b = b, a % b\n    return a\n"
    assert run_tests(ok, spec) == CodeResult(True, 3, 3, 3, None, "")
    # Right only for coprime inputs: (7, 5) -> 1 passes, the other two do not.
    wrong = "def gcd(a, b):\n    return 1\n"
    result = run_tests(wrong, spec)
    assert (result.passed, result.tests_passed, result.failure) == (False, 1, "wrong_answer")
    assert "expected 6, got 1" in result.details


def test_call_based_solution_class_tuples_and_wrapped_outputs():
    spec = {"fn_name": "divmod2", "inputs": [[17, 5], [9, 3]], "outputs": [[[3, 2]], [3, 0]]}
    program = "class Solution:\n    def divmod2(self, a, b):\n        return divmod(a, b)\n"
    assert run_tests(program, spec).passed


def test_call_based_float_tolerance_and_types():
    spec = {"fn_name": "mean", "inputs": [[[1, 2]], [[0.1, 0.2]]], "outputs": [1.5, 0.15]}
    assert run_tests("def mean(xs):\n    return sum(xs) / len(xs)\n", spec).passed
    as_text = run_tests("def mean(xs):\n    return str(sum(xs) / len(xs))\n", spec)
    assert as_text.failure == "wrong_answer"


def test_call_based_failure_kinds():
    spec = {"fn_name": "f", "inputs": [[1], [2]], "outputs": [1, 2]}
    loop = run_tests("def f(x):\n    while True:\n        pass\n", spec, timeout_s=0.4)
    assert (loop.failure, loop.tests_run, loop.tests_passed) == ("timeout", 2, 0)
    crash = run_tests("def f(x):\n    return [][x]\n", spec)
    assert crash.failure == "crash" and "IndexError" in crash.details
    missing = run_tests("def g(x):\n    return x\n", spec)
    assert missing.failure == "crash" and "'f'" in missing.details
    unserializable = run_tests("def f(x):\n    return {x}\n", spec)
    assert unserializable.failure == "wrong_answer"


def test_call_based_rigged_equality_does_not_pass():
    spec = {"fn_name": "f", "inputs": [[1]], "outputs": [42]}
    rigged = ("class Anything:\n    def __eq__(self, other):\n        return True\n"
              "def f(x):\n    return Anything()\n")
    assert not run_tests(rigged, spec).passed
    int_subclass = ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                    "def f(x):\n    return Int(7)\n")
    assert not run_tests(int_subclass, spec).passed


# ------------------------------------------------------------------------------------
# Spec normalisation
# ------------------------------------------------------------------------------------

def test_normalize_tests_layouts():
    lcb = [{"input": "[1, 2]\n3", "output": "[4, 5]", "testtype": "functional",
            "metadata": {"func_name": "addAll"}}]
    assert normalize_tests(lcb) == {"fn_name": "addAll", "inputs": [[[1, 2], 3]],
                                    "outputs": [[4, 5]]}
    taco = json.dumps({"inputs": [["a", 1]], "outputs": [["b"]], "fn_name": "shift"})
    assert normalize_tests(taco) == {"fn_name": "shift", "inputs": [["a", 1]],
                                     "outputs": [["b"]]}
    stdio = {"inputs": [["1", "2"]], "outputs": ["3\n"]}
    assert normalize_tests(stdio) == [{"input": "1\n2", "output": "3\n"}]
    pi = [{"type": "function_call", "fn_name": "f", "input": [1], "output": [2]}]
    assert normalize_tests(pi) == {"fn_name": "f", "inputs": [[1]], "outputs": [[2]]}
    he = {"test": "def check(c): pass", "entry_point": "f"}
    assert normalize_tests(he) == he


@pytest.mark.parametrize("raw, message", [
    ("not json", "not valid JSON"),
    ([], "empty"),
    ({"inputs": [1]}, "'inputs' and 'outputs'"),
    ({"inputs": ["1"], "outputs": []}, "1 inputs but 0 outputs"),
    ({"fn_name": "f", "inputs": [], "outputs": []}, "no cases"),
    ([{"input": "1"}], "'input' and 'output'"),
    ([{"input": "1", "output": "1"}, {"input": [1], "output": 1, "fn_name": "f"}], "mix"),
    ([{"input": "1", "output": "1", "testtype": "functional"}], "function name"),
    (42, "unsupported"),
])
def test_normalize_tests_rejects_bad_specs(raw, message):
    with pytest.raises(ValueError, match=message):
        normalize_tests(raw)


# ------------------------------------------------------------------------------------
# Code extraction
# ------------------------------------------------------------------------------------

def test_extract_code_takes_the_last_python_block():
    text = ("First try:\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\n"
            "Output:\n```text\n2\n```\n")
    assert extract_code(text) == "print(2)"
    assert extract_code("```\nx = 1\ny = 2\n```") == "x = 1\ny = 2"


def test_extract_code_without_fence_is_none():
    assert extract_code("The answer is print(3), no code block here.") is None
    assert extract_code("```bash\nls\n```") is None
    assert score("no code at all", SUM_TESTS) == Score(0.0, None, 0.0, "no code block")


def test_extract_code_unclosed_final_fence():
    text = "```python\nprint(1)\n```\nNow the fix:\n```python\ndef f():\n    return 2\n"
    assert extract_code(text) == "def f():\n    return 2"


def test_extract_code_keeps_indentation_and_inner_backticks():
    text = "```python\ns = '``'\nif s:\n    print(s)\n```"
    assert extract_code(text) == "s = '``'\nif s:\n    print(s)"


# ------------------------------------------------------------------------------------
# JSONL loader
# ------------------------------------------------------------------------------------

FIXTURE_SOLUTIONS = {
    "pi-sum": "a, b = map(int, input().split())\nprint(a + b)\n",
    "taco-count-vowels": "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s)\n",
    "lcb-max-window": ("class Solution:\n    def maxWindowSum(self, nums, k):\n"
                       "        return max(sum(nums[i:i + k]) for i in range(len(nums) - k + 1))\n"),
    "lcb-stdin-squares": "n = int(input())\nfor i in range(1, n + 1):\n    print(i * i)\n",
    "taco-reverse": "print(input()[::-1])\n",
}


def test_load_code_jsonl_fixture_and_reference_solutions():
    tasks = load_code_jsonl(FIXTURE, id_key="id")
    assert [t.task_id for t in tasks] == list(FIXTURE_SOLUTIONS)
    assert all(t.kind == "code" and t.question for t in tasks)
    by_id = {t.task_id: t for t in tasks}
    assert by_id["lcb-max-window"].answer["fn_name"] == "maxWindowSum"
    assert by_id["lcb-max-window"].answer["inputs"][0] == [[1, 4, 2, 10, 2], 2]
    assert by_id["pi-sum"].meta["num_tests"] == 3
    texts = [_fenced(FIXTURE_SOLUTIONS[t.task_id]) for t in tasks]
    scores = score_many(texts, [t.answer for t in tasks])
    assert [s.reward for s in scores] == [1.0] * len(tasks), [s.info for s in scores]
    # A wrong solution for each fails.
    wrong = [_fenced("print(0)"), _fenced("def count_vowels(s):\n    return 0\n"),
             _fenced("class Solution:\n    def maxWindowSum(self, nums, k):\n        return 0\n"),
             _fenced("print(1)"), _fenced("print(input())")]
    scores = score_many(wrong, [t.answer for t in tasks])
    assert [s.reward for s in scores] == [0.0] * len(tasks)
    assert scores[1].partial == pytest.approx(1 / 3)  # "rhythm" has no vowels


def test_load_code_jsonl_ids_and_limit():
    tasks = load_code_jsonl(FIXTURE, limit=2)
    assert [t.task_id for t in tasks] == ["code_sample/1", "code_sample/2"]
    assert load_code_jsonl(FIXTURE, limit=0) == []


def test_load_code_jsonl_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="code dataset not found"):
        load_code_jsonl(tmp_path / "missing.jsonl")
    good = json.dumps({"problem": "p", "tests": [{"input": "1", "output": "1"}]})
    cases = {
        "bad_json": (good + "\n{not json\n", "row 2: invalid JSON"),
        "missing_key": (good + "\n" + json.dumps({"problem": "p"}) + "\n",
                        "row 2: missing key 'tests'"),
        "bad_tests": (json.dumps({"problem": "p", "tests": "[{\"input\": 1}]"}) + "\n",
                      "row 1: key 'tests'"),
        "empty_question": (json.dumps({"problem": "", "tests": [{"input": "", "output": ""}]}),
                           "row 1: key 'problem'"),
        "not_object": ("[1, 2]\n", "row 1: expected a JSON object"),
    }
    for name, (content, message) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(content)
        with pytest.raises(ValueError, match=message):
            load_code_jsonl(path)
    with pytest.raises(ValueError, match="missing key 'uid'"):
        path = tmp_path / "ok.jsonl"
        path.write_text(good + "\n")
        load_code_jsonl(path, id_key="uid")


def test_run_tests_rejects_bad_arguments():
    with pytest.raises(TypeError, match="program"):
        run_tests(None, SUM_TESTS)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s"):
        run_tests("print(1)", SUM_TESTS, timeout_s=0)
    with pytest.raises(ValueError, match="texts"):
        score_many(["a"], [])
    assert code.run_tests_many([]) == []
