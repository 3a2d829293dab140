"""Host-side text glue between workflow stages: verdicts, selections and work items.

Each parser is total: it never raises on model output, and reports which rule fired so rollouts can
log how often models follow the requested format.
"""
from __future__ import annotations

import re

from marl_jax.tasks.math import match_braces  # one brace matcher for every parser

__all__ = [
    "boxed_contents",
    "last_boxed",
    "parse_verdict",
    "parse_selection",
    "parse_items",
    "ITEM_KEYWORDS",
]

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")


def boxed_contents(text: str) -> list[str]:
    """Contents of every complete ``\\boxed{...}`` / ``\\fbox{...}`` in order of appearance.

    Nested braces are matched; the brace-less form ``\\boxed 2`` yields the following word; an unclosed
    box (truncated output) is skipped.
    """
    out = []
    for m in _BOX_RE.finditer(text or ""):
        j = m.end()
        while j < len(text) and text[j] == " ":
            j += 1
        if j < len(text) and text[j] == "{":
            k = match_braces(text, j)
            if k is not None:
                out.append(text[j + 1:k])
        elif j > m.end():
            word = re.match(r"[^\s$]+", text[j:])
            if word:
                out.append(word.group(0))
    return out


def last_boxed(text: str) -> str | None:
    """Content of the last complete box, or None."""
    boxes = boxed_contents(text)
    return boxes[-1] if boxes else None


_TEXT_WRAP_RE = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")


def _plain(box: str) -> str:
    """Box content reduced to lower-case letters: '\\text{ Correct. }' -> 'correct'."""
    prev = None
    while prev != box:  # unwrap nested \\text{\\textbf{...}}
        prev, box = box, _TEXT_WRAP_RE.sub(r"\1", box)
    return re.sub(r"[^a-z]", "", box.lower())


_VERDICTS = {"correct": True, "incorrect": False, "notcorrect": False}


def parse_verdict(text: str) -> bool | None:
    """An evaluator's verdict: True for a boxed Correct, False for a boxed Incorrect, None for none.

    The last box that holds a verdict wins (an evaluator that boxes something else after its verdict
    still gets its verdict read). Callers treat None as Incorrect.
    """
    for box in reversed(boxed_contents(text)):
        v = _VERDICTS.get(_plain(box))
        if v is not None:
            return v
    return None


def parse_selection(text: str, n: int) -> tuple[int, str]:
    """Which of n numbered solutions (1-based in the text) an aggregator picked, as a 0-based index.

    Rules, first that applies: the first integer inside the last box, if in 1..n ("boxed"); the first
    digit 1-9 in the text that is at most n ("digit"); solution 1 ("default").
    """
    if n < 1:
        raise ValueError(f"parse_selection needs n >= 1 solutions; got {n}")
    box = last_boxed(text)
    if box is not None:
        num = re.search(r"\d+", box)
        if num and 1 <= int(num.group(0)) <= n:
            return int(num.group(0)) - 1, "boxed"
    for ch in re.findall(r"[1-9]", text or ""):
        if int(ch) <= n:
            return int(ch) - 1, "digit"
    return 0, "default"


ITEM_KEYWORDS = ("SUBTASK", "STRATEGY")
# A marker needs its colon ("STRATEGY 2:") so that prose such as "strategy 1 fails" is not an item.
_MARKER_RE = re.compile(r"(?i)\b(?:" + "|".join(ITEM_KEYWORDS) + r")\s*#?\s*\d+\s*\**\s*:\**")
_NUMBERED_RE = re.compile(r"^\s*(?:\*\*)?\(?\d+[.)](?:\*\*)?\s+(\S.*)$")
_MIN_LINE_CHARS = 11  # "long lines": anything shorter is a heading or filler, not an item


def _marker_items(text: str) -> list[str]:
    marks = list(_MARKER_RE.finditer(text))
    items = []
    for a, b in zip(marks, marks[1:] + [None]):
        body = text[a.end():b.start() if b is not None else len(text)]
        body = body.strip().strip("*").strip()
        if body:
            items.append(body)
    return items


def _numbered_items(text: str) -> list[str]:
    items: list[list[str]] = []
    open_item = False  # continuation lines attach until a blank line
    for line in text.splitlines():
        m = _NUMBERED_RE.match(line)
        if m:
            items.append([m.group(1).strip()])
            open_item = True
        elif not line.strip():
            open_item = False
        elif open_item and items:
            items[-1].append(line.strip())
    return [" ".join(parts).strip() for parts in items if " ".join(parts).strip()]


def _long_lines(text: str) -> list[str]:
    return [s for s in (line.strip() for line in text.splitlines()) if len(s) >= _MIN_LINE_CHARS]


def parse_items(text: str, max_items: int) -> tuple[list[str], str]:
    """An orchestrator's work items (subtasks or strategies), at most max_items, and the rule used.

    Rules, first that yields anything: "SUBTASK k:" / "STRATEGY k:" markers ("marker"); a numbered list
    "1." / "2)" with continuation lines ("numbered"); lines of at least 11 characters ("lines"); the
    whole stripped output as one item ("whole"). The result is truncated to max_items.
    """
    if max_items < 1:
        raise ValueError(f"max_items must be >= 1; got {max_items}")
    text = text or ""
    for method, rule in (("marker", _marker_items), ("numbered", _numbered_items),
                         ("lines", _long_lines)):
        items = rule(text)
        if items:
            return items[:max_items], method
    return [text.strip()], "whole"
