"""Math tasks: the reward agrees with math-verify; extraction edge cases; task sources and loaders."""
from __future__ import annotations

import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest
from math_verify import parse, verify

from marl_jax.tasks.base import Score, Task
from marl_jax.tasks.math import (
    REASONING_GYM_TASKS,
    extract_answer,
    extract_boxed,
    extract_last_number,
    is_equivalent,
    load_math_file,
    normalize_answer,
    reasoning_gym_tasks,
    score,
)

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "math_sample.jsonl")


def _mv_label(gold: str, text: str) -> float:
    """The reference label: math-verify on the whole output text, gold given as LaTeX."""
    return 1.0 if verify(parse(f"${gold}$"), parse(text)) else 0.0


def _variants(gold: str) -> list[tuple[str, bool]]:
    """(output text, boxed?) pairs for an integer gold answer: right, equivalent, wrong, unboxed."""
    a = int(gold)
    texts = [
        f"We work it out step by step.\nSo the answer is $\\boxed{{{a}}}$.",  # right
        f"The final answer is \\boxed{{ {a} }}",  # extra spaces
        f"Therefore \\boxed{{{a}.0}}",  # decimal form
        f"\\boxed{{\\frac{{{2 * a}}}{{2}}}}",  # unreduced fraction
        f"\\boxed{{\\text{{{a}}}}}",  # wrapped in \text
        f"Answer: \\boxed{{{a + 1}}}",  # wrong
        f"Answer: \\boxed{{{a - 1}}}",
        f"Answer: \\boxed{{{-a if a else 7}}}",
        f"Answer: \\boxed{{{a}1}}",  # digit appended
        f"Answer: \\boxed{{{a}.5}}",
        f"Answer: \\boxed{{\\frac{{{a}}}{{3}}}}" if a else "Answer: \\boxed{\\frac{1}{3}}",
    ]
    if abs(a) >= 1000:
        texts.append(f"That is \\boxed{{{a:,}}} in total.")  # thousands separators
    out = [(t, True) for t in texts]
    out.append((f"The answer is {a}.", False))  # right number, no box
    return out


def _generated_cases() -> list[tuple[str, str, bool]]:
    """(text, gold, boxed?) cases built from reasoning-gym tasks."""
    cases: list[tuple[str, str, bool]] = []
    tasks = (
        reasoning_gym_tasks("basic_arithmetic", 16, seed=3, min_terms=2, max_terms=3, min_digits=1, max_digits=4)
        + reasoning_gym_tasks("chain_sum", 12, seed=4)
        + reasoning_gym_tasks("gsm_symbolic", 12, seed=5)
    )
    for t in tasks:
        if not re.fullmatch(r"-?\d+", t.answer):
            continue  # gsm_symbolic has the odd decimal answer; the variants assume integers
        cases += [(text, t.answer, boxed) for text, boxed in _variants(t.answer)]
        # A non-integer gold derived from the task: (2a+1)/2 as a fraction, predicted as a decimal.
        a = int(t.answer)
        half = f"\\frac{{{2 * a + 1}}}{{2}}"
        cases += [
            (f"\\boxed{{{(2 * a + 1) / 2}}}", half, True),
            (f"\\boxed{{\\dfrac{{{4 * a + 2}}}{{4}}}}", half, True),
            (f"\\boxed{{{a}}}", half, True),
        ]
    for t in reasoning_gym_tasks("fraction_simplification", 8, seed=6):
        num, den = (int(x) for x in re.findall(r"\d+", t.answer))  # "a/b" or "\\dfrac{a}{b}" styles
        cases += [
            (f"\\boxed{{\\frac{{{num}}}{{{den}}}}}", t.answer, True),
            (f"\\boxed{{{2 * num}/{2 * den}}}", t.answer, True),
            (f"\\boxed{{{den}/{num}}}", t.answer, True),
            (f"\\boxed{{{num / den:.3f}}}", t.answer, True),
        ]
    return cases


def test_reward_agrees_with_math_verify_on_generated_cases():
    cases = _generated_cases()
    labels = []
    for text, gold, boxed in cases:
        expected = _mv_label(gold, text) if boxed else 0.0  # no box scores 0 by the reward rule
        got = score(text, gold)
        assert isinstance(got, Score)
        assert got.reward == expected, (text, gold, got)
        labels.append(expected)
    assert len(cases) >= 200
    assert labels.count(1.0) >= 80 and labels.count(0.0) >= 80  # both outcomes well covered


HAND_CASES = [
    # (output, gold, reward) worked out by hand
    ("so \\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac12", 1.0),
    ("\\boxed{1,234}", "1234", 1.0),
    ("\\boxed{1234}", "1,234", 1.0),
    ("\\boxed{124}", "1234", 0.0),
    ("\\boxed{-3}", "3", 0.0),
    ("\\boxed{90^\\circ}", "90", 1.0),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)", 1.0),
    ("\\boxed{(2, 1)}", "(1,2)", 0.0),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
    ("\\boxed{\\sqrt{2}}", "2", 0.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("\\boxed{$7$}", "7", 1.0),
    ("\\fbox{7}", "7", 1.0),
    ("so the result is \\boxed 7$.", "7", 1.0),
    ("first \\boxed{3}, then on reflection \\boxed{5}", "5", 1.0),  # last box counts
    ("first \\boxed{5}, then on reflection \\boxed{3}", "5", 0.0),
    ("The answer is 5.", "5", 0.0),  # no box
    ("\\boxed{}", "5", 0.0),
    ("truncated \\boxed{5", "5", 0.0),
    ("", "5", 0.0),
]


@pytest.mark.parametrize("text,gold,reward", HAND_CASES)
def test_hand_known_cases(text, gold, reward):
    assert score(text, gold).reward == reward


def test_trailing_period_is_a_deliberate_leniency():
    # A sentence-final period inside the box is formatting; math-verify alone rejects it.
    assert score("\\boxed{42.}", "42").reward == 1.0
    assert not verify(parse("$42$"), parse("\\boxed{42.}"))


def test_score_fields_and_non_string_answers():
    s = score("thus \\boxed{ 12 }", 12)
    assert (s.reward, s.extracted) == (1.0, "12")
    s = score("no box, 12", "12")
    assert s.reward == 0.0 and s.extracted is None
    assert score("no box, 12", "12", mode="last_number") == Score(reward=1.0, extracted="12", info="correct")


def test_normalize_answer():
    assert normalize_answer(" $\\dfrac{1}{2}$ ") == normalize_answer("\\frac{1}{2}")
    assert normalize_answer("\\text{ 5 }.") == "5"
    assert normalize_answer("1,234,567") == "1234567"
    assert normalize_answer("1{,}250") == "1250"
    assert normalize_answer("+2.50") == "2.5"
    assert normalize_answer("3.000") == "3"
    assert normalize_answer("\\left(1,\\ 2\\right)") == "(1,2)"
    assert normalize_answer("45^{\\circ}") == "45"
    assert normalize_answer("1,2") == "1,2"  # not a thousands group: kept
    assert normalize_answer("5 apples") == "5apples"  # words are kept
    assert normalize_answer("100") == "100"  # integer zeros are not trimmed


def test_is_equivalent_from_worker_threads():
    pairs = [("0.5", "\\frac{1}{2}"), ("(x+1)^2", "x^2+2x+1"), ("3", "4"), ("\\sqrt{8}", "2\\sqrt{2}"), ("7", "7.5")]
    main = [is_equivalent(p, t) for p, t in pairs]
    assert main == [True, True, False, True, False]
    with ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda pt: is_equivalent(*pt), pairs))
    assert threaded == main


def test_is_equivalent_rejects_empty_and_huge():
    assert not is_equivalent("", "5")
    assert not is_equivalent(None, "5")
    assert not is_equivalent("1+" * 2000 + "1", "2001")  # too long to hand to sympy


# --- extraction -------------------------------------------------------------------------------


def test_extract_boxed_edge_cases():
    assert extract_boxed("\\boxed{\\frac{a}{\\sqrt{b^{2}}}}") == "\\frac{a}{\\sqrt{b^{2}}}"
    assert extract_boxed("\\boxed{1} and \\boxed{2} and finally \\boxed{ {3} }") == "{3}"
    assert extract_boxed("$\\boxed 5$") == "5"
    assert extract_boxed("\\boxed 12 apples") == "12"
    assert extract_boxed("\\fbox{x+1}") == "x+1"
    assert extract_boxed("\\boxed {4}") == "4"
    assert extract_boxed("\\boxed{\\{1, 2\\}}") == "\\{1, 2\\}"  # escaped braces are not groups
    assert extract_boxed("no box here") is None
    assert extract_boxed("\\boxed{1} then truncated \\boxed{2") is None
    assert extract_boxed("\\boxedfoo{3}") is None
    assert extract_boxed("\\boxed{}") is None  # an empty box holds no answer ...
    assert extract_boxed("\\boxed{4}, as asked: \\boxed{ }") == "4"  # ... and is skipped
    assert extract_boxed("\\boxed{4} and \\boxed") == "4"
    assert extract_boxed("") is None


def test_extract_last_number():
    assert extract_last_number("So 3 + 4 = 7.") == "7"
    assert extract_last_number("It costs $1,234.50 in total") == "1234.50"
    assert extract_last_number("2 - -1 = 3") == "3"
    assert extract_last_number("the result is -12") == "-12"
    assert extract_last_number("the result is \u221212") == "-12"
    assert extract_last_number("so 9-4") == "4"  # binary minus, not a sign
    assert extract_last_number("so 9 - 4") == "4"
    assert extract_last_number("half is 1/2") == "1/2"
    assert extract_last_number("half is \\frac{1}{2}") == "1/2"
    assert extract_last_number("about .5 of it") == "0.5"
    assert extract_last_number("+8") == "8"
    assert extract_last_number("no digits") is None
    assert extract_last_number("") is None


def test_extract_answer_modes():
    text = "I get \\boxed{3}, though 4 is tempting"
    assert extract_answer(text, "boxed") == "3"
    assert extract_answer(text, "last_number") == "4"
    assert extract_answer(text, "boxed_or_last_number") == "3"
    assert extract_answer("maybe 4", "boxed_or_last_number") == "4"
    assert extract_answer("maybe 4", "boxed") is None
    assert extract_answer("so 2 + 2 = 4, answer in \\boxed{}", "boxed_or_last_number") == "4"
    with pytest.raises(ValueError, match="last_number"):
        extract_answer("x", "first_number")


def test_lenient_mode_scores():
    assert score("5 + 3 = 8", "8", mode="last_number").reward == 1.0
    assert score("The total is 1,234 apples.", "1234", mode="last_number").reward == 1.0
    assert score("so it is -7.", "-7", mode="last_number").reward == 1.0
    assert score("so it is 7.", "-7", mode="last_number").reward == 0.0
    assert score("0.5", "\\frac{1}{2}", mode="last_number").reward == 1.0
    assert score("nothing", "1", mode="last_number").reward == 0.0


# --- reasoning-gym sources ---------------------------------------------------------------------


def _eval_expression(expr: str) -> Fraction | None:
    """Exact value of an arithmetic expression, evaluated here independently of reasoning-gym."""
    try:
        return eval(re.sub(r"\d+", lambda m: f"Fraction({m.group(0)})", expr), {"Fraction": Fraction})
    except ZeroDivisionError:
        return None


def test_basic_arithmetic_difficulty_knobs():
    tasks = reasoning_gym_tasks("basic_arithmetic", 64, seed=0, min_terms=2, max_terms=2, min_digits=1, max_digits=1)
    assert len(tasks) == 64 and len({t.task_id for t in tasks}) == 64
    for t in tasks:
        assert t.kind == "math" and isinstance(t.answer, str)
        expr = t.meta["metadata"]["expression"]
        assert expr in t.question
        numbers = re.findall(r"\d+", expr)
        assert len(numbers) == 2 and all(len(x) == 1 for x in numbers), expr
        assert _eval_expression(expr) == int(t.answer)
    # The easiest form: "a + b" / "a - b" with non-negative constants (reasoning-gym's simple
    # generator draws them from 0..10 inclusive).
    simple = reasoning_gym_tasks(
        "basic_arithmetic", 32, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1,
        operators=("+", "-"), allow_parentheses=False, allow_negation=False,
    )
    for t in simple:
        expr = t.meta["metadata"]["expression"]
        m = re.fullmatch(r"(\d+) ([+-]) (\d+)", expr)
        assert m and 0 <= int(m.group(1)) <= 10 and 0 <= int(m.group(3)) <= 10, expr
        assert _eval_expression(expr) == int(t.answer)


@pytest.mark.parametrize(
    "settings",
    [
        dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, allow_parentheses=False),  # shown divisor != used
        dict(min_terms=2, max_terms=6, min_digits=1, max_digits=4),  # floor division of non-exact quotients
    ],
)
def test_basic_arithmetic_answers_are_exact(settings):
    import reasoning_gym

    # reasoning-gym itself states some wrong answers under these settings ...
    raw = reasoning_gym.create_dataset("basic_arithmetic", seed=0, size=300, **settings)
    assert any(_eval_expression(x["metadata"]["expression"]) != int(x["answer"]) for x in raw)
    # ... and none of them become tasks.
    for t in reasoning_gym_tasks("basic_arithmetic", 200, seed=0, **settings):
        assert _eval_expression(t.meta["metadata"]["expression"]) == Fraction(t.answer), t


def test_chain_sum_difficulty_knobs():
    for t in reasoning_gym_tasks("chain_sum", 32, seed=2, min_terms=3, max_terms=3, min_digits=2, max_digits=2):
        expr = t.meta["metadata"]["expression"]
        numbers = re.findall(r"\d+", expr)
        assert len(numbers) == 3 and all(10 <= int(x) <= 99 for x in numbers), expr
        assert _eval_expression(expr) == int(t.answer)


def test_gsm_symbolic_and_determinism():
    a = reasoning_gym_tasks("gsm_symbolic", 10, seed=7)
    b = reasoning_gym_tasks("gsm_symbolic", 10, seed=7)
    c = reasoning_gym_tasks("gsm_symbolic", 10, seed=8)
    assert [(t.question, t.answer) for t in a] == [(t.question, t.answer) for t in b]
    assert [t.question for t in a] != [t.question for t in c]
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", t.answer) for t in a)
    # The first k tasks do not depend on n.
    assert [t.question for t in reasoning_gym_tasks("gsm_symbolic", 4, seed=7)] == [t.question for t in a[:4]]


def test_reasoning_gym_errors():
    with pytest.raises(ValueError) as e:
        reasoning_gym_tasks("no_such_task", 3, seed=0)
    for name in ("basic_arithmetic", "chain_sum", "gsm_symbolic"):
        assert name in str(e.value) and name in REASONING_GYM_TASKS
    with pytest.raises(TypeError, match="max_terms"):  # names the valid settings
        reasoning_gym_tasks("basic_arithmetic", 3, seed=0, max_term=2)
    with pytest.raises(ValueError, match="max_terms"):
        reasoning_gym_tasks("basic_arithmetic", 3, seed=0, min_terms=3, max_terms=2)
    with pytest.raises(ValueError, match="n must be"):
        reasoning_gym_tasks("chain_sum", 0, seed=0)


# --- file loaders ------------------------------------------------------------------------------

# Final answers of the fixture's problems, worked out by hand: 48 + 24, 1/2 + 1/3, sqrt(50), 125 * 10.
FIXTURE_ANSWERS = {"gsm-1": 72, "math-1": Fraction(5, 6), "math-2": "5\\sqrt{2}", "gsm-2": 1250}


def _check_answers(tasks: list[Task]):
    assert [t.task_id for t in tasks] == list(FIXTURE_ANSWERS)
    for t in tasks:
        assert t.kind == "math"
        truth = FIXTURE_ANSWERS[t.task_id]
        if isinstance(truth, int):
            assert int(normalize_answer(t.answer)) == truth
        elif isinstance(truth, Fraction):
            assert is_equivalent(t.answer, f"{truth.numerator}/{truth.denominator}")
        else:
            assert normalize_answer(t.answer) == truth


def test_load_jsonl_gsm8k_math_and_dapo_styles():
    gsm = load_math_file(FIXTURE, id_key="id")  # "answer": GSM8K "#### x" or a plain answer
    _check_answers(gsm)
    assert gsm[0].answer == "72" and gsm[0].question.startswith("Natalia sold clips")
    math_style = load_math_file(FIXTURE, answer_key="solution", id_key="id")  # \boxed in solutions
    _check_answers(math_style)
    assert math_style[2].answer == "5\\sqrt{2}"
    dapo = load_math_file(FIXTURE, question_key="prompt", answer_key="reward_model.ground_truth", id_key="id")
    _check_answers(dapo)
    assert dapo[0].question == gsm[0].question  # last user message of the chat prompt
    default_ids = load_math_file(FIXTURE, limit=2)
    assert [t.task_id for t in default_ids] == ["math_sample/0", "math_sample/1"]


def test_load_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    with open(FIXTURE) as f:
        rows = [json.loads(line) for line in f]
    path = tmp_path / "sample.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    tasks = load_math_file(path, question_key="prompt", answer_key="reward_model.ground_truth", id_key="id")
    _check_answers(tasks)
    from_jsonl = load_math_file(FIXTURE, question_key="prompt", answer_key="reward_model.ground_truth", id_key="id")
    assert [(t.question, t.answer) for t in tasks] == [(t.question, t.answer) for t in from_jsonl]
    _check_answers(load_math_file(path, answer_key="solution", id_key="id"))


def test_load_json_list(tmp_path):
    path = tmp_path / "gsm.json"
    path.write_text(json.dumps([{"question": "1+1?", "answer": "it is 2\n#### 2"}]))
    (t,) = load_math_file(path, question_key="question")
    assert (t.question, t.answer, t.task_id) == ("1+1?", "2", "gsm/0")


def test_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_math_file(tmp_path / "nope.jsonl")
    with pytest.raises(KeyError) as e:
        load_math_file(FIXTURE, question_key="question")
    assert "question" in str(e.value) and "row 0" in str(e.value) and "question_key" in str(e.value)
    assert "problem" in str(e.value)  # lists the keys that do exist
    with pytest.raises(KeyError, match="reward_model.truth"):
        load_math_file(FIXTURE, answer_key="reward_model.truth")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "a", "answer": "1"}\n{not json}\n')
    with pytest.raises(ValueError, match="line 2"):
        load_math_file(bad)
    missing = tmp_path / "missing.jsonl"
    missing.write_text('{"problem": "a", "answer": "1"}\n{"problem": "b"}\n')
    with pytest.raises(KeyError, match="row 1"):
        load_math_file(missing)
    empty_answer = tmp_path / "empty.jsonl"
    empty_answer.write_text('{"problem": "a", "answer": "   "}\n')
    with pytest.raises(ValueError, match="row 0: empty answer"):
        load_math_file(empty_answer)
    unclosed = tmp_path / "unclosed.jsonl"
    unclosed.write_text(json.dumps({"problem": "a", "solution": "so \\boxed{12"}) + "\n")
    with pytest.raises(ValueError, match="row 0: answer has a .boxed but no complete"):
        load_math_file(unclosed, answer_key="solution")
    csv = tmp_path / "data.csv"
    csv.write_text("problem,answer\n")
    with pytest.raises(ValueError, match="jsonl"):
        load_math_file(csv)
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "problem": "a", "answer": "1"}\n{"id": 1, "problem": "b", "answer": "2"}\n')
    with pytest.raises(ValueError, match="duplicate task id"):
        load_math_file(dup, id_key="id")


def test_missing_pyarrow_message(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_pyarrow(name, *args, **kwargs):
        if name.startswith("pyarrow"):
            raise ImportError("no pyarrow")
        return real_import(name, *args, **kwargs)

    path = tmp_path / "x.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_math_file(path)
