"""Host-side parsers: verdicts, selections, items, boxes."""
import pytest

from marl_jax.workflows.parsing import (boxed_contents, last_boxed, parse_items, parse_selection,
                                        parse_verdict)


def test_boxed_contents_nested_and_unclosed():
    text = r"first \boxed{1} then \boxed{\frac{a}{b}} and \fbox{x} then \boxed 7$ and \boxed{oops"
    assert boxed_contents(text) == ["1", r"\frac{a}{b}", "x", "7"]
    assert last_boxed(text) == "7"
    assert last_boxed("no box here") is None
    assert last_boxed(r"\boxedx{3}") is None  # a different macro


@pytest.mark.parametrize("text,expected", [
    (r"The work is fine. \boxed{Correct}", True),
    (r"Wrong sign in step 2. \boxed{Incorrect}", False),
    (r"\boxed{\text{Correct}}", True),
    (r"\boxed{\textbf{INCORRECT.}}", False),
    (r"Verdict: \boxed{ correct }", True),
    (r"\boxed{Not correct}", False),
    ("The answer is correct.", None),            # no box: no verdict
    (r"The answer should be \boxed{5}", None),    # a box, but not a verdict
    (r"\boxed{Incorrect}. It should be \boxed{12}.", False),  # last verdict box wins
    (r"\boxed{Incorrect} ... on reflection \boxed{Correct}", True),
    ("", None),
])
def test_parse_verdict(text, expected):
    assert parse_verdict(text) is expected


@pytest.mark.parametrize("text,n,expected", [
    (r"Solution 3 is right. \boxed{2}", 3, (1, "boxed")),
    (r"\boxed{Solution 3}", 3, (2, "boxed")),
    (r"I pick \boxed{7} and solution 2", 3, (1, "digit")),    # boxed out of range -> first digit
    ("I think solution 2 is best, not 3", 3, (1, "digit")),
    ("Answer 0 and 8, then 3.", 3, (2, "digit")),            # 0 is not 1-9; 8 > n is skipped
    ("none of them", 3, (0, "default")),
    ("", 3, (0, "default")),
    (r"\boxed{4}", 5, (3, "boxed")),
])
def test_parse_selection(text, n, expected):
    assert parse_selection(text, n) == expected


def test_parse_selection_rejects_bad_n():
    with pytest.raises(ValueError, match="n >= 1"):
        parse_selection("1", 0)


def test_parse_items_marker_format():
    text = ("Here is my plan.\nSTRATEGY 1: Use algebra to isolate x.\n"
            "STRATEGY 2: Plug in small values\nand look for a pattern.\n"
            "**Strategy 3:** Draw a picture.\n")
    items, how = parse_items(text, 3)
    assert how == "marker"
    assert items == ["Use algebra to isolate x.", "Plug in small values\nand look for a pattern.",
                     "Draw a picture."]
    items, how = parse_items("SUBTASK 1: find a. SUBTASK 2: find b.", 5)
    assert (items, how) == (["find a.", "find b."], "marker")


def test_parse_items_marker_needs_colon():
    # "strategy 1 fails" is prose, so this falls through to the numbered list.
    text = "The strategy 1 fails here.\n1. Factor the polynomial\n2) Use the rational root test"
    items, how = parse_items(text, 3)
    assert how == "numbered"
    assert items == ["Factor the polynomial", "Use the rational root test"]


def test_parse_items_numbered_with_continuation_and_truncation():
    text = ("Plan:\n1. Compute the area\n   of the triangle\n2. Compute the height\n\n"
            "Some closing remark\n3. Divide\n4. Check the result")
    items, how = parse_items(text, 3)
    assert how == "numbered"
    assert items == ["Compute the area of the triangle", "Compute the height", "Divide"]


def test_parse_items_long_lines_then_whole():
    text = "Ideas\n\nTry completing the square\nok\nUse the quadratic formula directly\n"
    items, how = parse_items(text, 3)
    assert how == "lines"
    assert items == ["Try completing the square", "Use the quadratic formula directly"]
    items, how = parse_items("  short  ", 3)
    assert (items, how) == (["short"], "whole")
    items, how = parse_items("", 3)
    assert (items, how) == ([""], "whole")


def test_parse_items_truncates_markers():
    text = "\n".join(f"SUBTASK {k}: step number {k}" for k in range(1, 6))
    items, how = parse_items(text, 2)
    assert how == "marker" and items == ["step number 1", "step number 2"]
    with pytest.raises(ValueError, match="max_items"):
        parse_items(text, 0)
