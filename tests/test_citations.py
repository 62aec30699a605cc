"""Every reference in the code and the docs resolves inside the repository.

- a citation of a docs file (``docs/formulas.md``, ``CONTRIBUTING.md``, a markdown link between docs
  pages) names a file that exists;
- a section it names, as a heading anchor (``docs/formulas.md#r0, #r1``) or a quoted title
  (``docs/algorithms.md, "Proximal sources"``), is a heading of that file;
- nothing cites a file that is not in the repository (the design notes the docs were written from).
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: A cited file, its first anchor and further ``, #anchor`` / `` and #anchor`` of the same file.
CITATION = re.compile(
    r"(?<![\w/.-])((?:docs/[\w/-]+|CONTRIBUTING|README)\.md)((?:#[\w-]+)?(?:(?:,\s*|\s+and\s+)#[\w-]+)*)"
    r"(?:,?\s+\"([^\"\n]+)\")?"
)
#: A markdown link inside a docs page, relative to the page: ``[text](page.md#anchor)``.
LINK = re.compile(r"\]\(([\w./-]+\.md)(#[\w-]+)?\)")
#: Files outside the repository that a citation might name (a spec or style guide kept elsewhere).
OUTSIDE = re.compile(
    r"STYLE\.md|spec/algorithms\.md|\bspec (?:sections? |§)?\d+(?:\.\d+)?[ab]?\b", re.IGNORECASE
)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower()
    return "".join(ch for ch in text if ch.isalnum() or ch in " -_").replace(" ", "-")


@cache
def headings(path: Path) -> tuple[list[str], set[str]]:
    """The headings of a markdown file (outside code fences) and their anchors (duplicates numbered)."""
    titles: list[str] = []
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        title = match.group(1).replace("`", "")
        base = slug(title)
        count = seen.get(base, 0)
        seen[base] = count + 1
        titles.append(title)
        anchors.add(base if count == 0 else f"{base}-{count}")
    return titles, anchors


def sources() -> list[Path]:
    out = [p for d in ("src", "tests", "benchmarks") for p in sorted((ROOT / d).rglob("*.py"))
           if p != Path(__file__)]
    out += sorted((ROOT / "docs").rglob("*.md"))
    return out + [ROOT / name for name in ("README.md", "CONTRIBUTING.md") if (ROOT / name).exists()]


def problems_in(path: Path, text: str) -> list[str]:
    """What in ``text`` (the contents of ``path``) cites something that does not exist."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    out: list[str] = []
    for match in OUTSIDE.finditer(text):
        out.append(f"{where}: {match.group(0)!r} cites a file outside the repository")
    for match in CITATION.finditer(text):
        name, anchors, title = match.groups()
        out += check(where, ROOT / name, name, re.findall(r"#([\w-]+)", anchors), title)
    if path.suffix == ".md":
        for match in LINK.finditer(text):
            target, anchor = match.groups()
            if "://" in target:
                continue
            anchors = [anchor[1:]] if anchor else []
            out += check(where, (path.parent / target).resolve(), target, anchors, None)
    return out


def check(where: Path, target: Path, name: str, anchors: list[str], title: str | None) -> list[str]:
    if not target.is_file():
        return [f"{where}: {name} does not exist"]
    if target.suffix != ".md":
        return []
    titles, known = headings(target)
    out = [f"{where}: {name} has no section #{a}" for a in anchors if a not in known]
    if title is not None and title[:1].isupper() and not any(title.lower() in t.lower() for t in titles):
        out.append(f"{where}: {name} has no section titled {title!r}")
    return out


def test_every_citation_resolves_inside_the_repository() -> None:
    found = [p for path in sources() for p in problems_in(path, path.read_text())]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("see docs/formulas.md#r0", None),
        ("see docs/formulas.md#r0, #r1 and #brace", None),
        ("see docs/formulas.md#no-such-section", "has no section #no-such-section"),
        ("see docs/formulas.md#r0, #nope", "has no section #nope"),
        ("see docs/no_such_page.md", "does not exist"),
        ('see docs/algorithms.md, "Proximal sources"', None),
        ('see docs/algorithms.md, "Improper sources"', "has no section titled"),
        ("as CONTRIBUTING.md#registries says", None),
        ("as CONTRIBUTING.md#registry says", "has no section #registry"),
        ("(spec 9.3)", "outside the repository"),
        ("(STYLE.md, point 5)", "outside the repository"),
    ],
)
def test_the_check_catches_each_kind_of_dangling_citation(text: str, problem: str | None) -> None:
    found = problems_in(ROOT / "src" / "example.py", text)
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and problem in found[0], found


def test_anchors_follow_github() -> None:
    assert (slug("COPC: two readings, and which one copc names")
            == "copc-two-readings-and-which-one-copc-names")
    assert slug("Confirmation: search, s = 64 (C3's panel)") == "confirmation-search-s--64-c3s-panel"
