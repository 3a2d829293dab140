"""README.md and docs/**/*.md: every relative link resolves, and the docs pages hold no measurement history.

A relative link (``[text](path)``, ``![alt](path)``, optionally ``path#anchor``) must name an existing file
or folder, relative to the page that holds it; an anchor into a Markdown file must match one of its
headings (GitHub's slugs). Links inside code spans and fenced code blocks are not links. No page under
docs/ contains the word "earlier": figures there are current values, their history is in git.
No JAX import: this runs in well under a second.
"""
from __future__ import annotations

import pathlib
import re
import urllib.parse

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_LINK = re.compile(r"!?\[(?:[^\]\\]|\\.)*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$")


def pages() -> list[pathlib.Path]:
    return [ROOT / "README.md"] + sorted(DOCS.rglob("*.md"))


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for i, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield i, line


def links(page: pathlib.Path) -> list[tuple[int, str]]:
    out = []
    for i, line in _prose_lines(page.read_text(encoding="utf-8")):
        for m in _LINK.finditer(_CODE_SPAN.sub("", line)):
            out.append((i, m.group(1).strip("<>")))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text only
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(page.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(1))
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def _rel(p: pathlib.Path) -> str:
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return str(p)


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


def broken_links(page: pathlib.Path) -> list[str]:
    bad = []
    for line_no, target in links(page):
        if _is_external(target):
            continue
        path_part, _, anchor = target.partition("#")
        path_part = urllib.parse.unquote(path_part)
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{_rel(page)}:{line_no}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            bad.append(f"{where} (no heading #{anchor} in {_rel(dest)})")
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    assert not broken_links(page), "\n".join(broken_links(page))


@pytest.mark.parametrize("page", sorted(DOCS.rglob("*.md")), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_pages_hold_no_history(page):
    hits = [f"{page.relative_to(ROOT)}:{i}: {line.strip()}"
            for i, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
            if re.search(r"\bearlier\b", line, re.IGNORECASE)]
    assert not hits, "docs pages give current values only (history is in git):\n" + "\n".join(hits)


def test_checker_sees_links_and_anchors(tmp_path):
    """The checker itself: a broken file link, a broken anchor and a code span are told apart."""
    (tmp_path / "a.md").write_text("# Top\n\n## Two words `x`\n")
    page = tmp_path / "p.md"
    page.write_text("[ok](a.md#two-words-x) [top](a.md#top) ![img](missing.png) [bad](a.md#nope)\n"
                    "`[not a link](nowhere.md)` [web](https://example.com/x)\n"
                    "```\n[fenced](nowhere.md)\n```\n[self](#local)\n\n## Local\n")
    bad = broken_links(page)
    assert len(bad) == 2 and "missing.png" in bad[0] and "#nope" in bad[1], bad
