"""Every relative link in the README and docs/ reaches a file that ships, and its heading."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The page without its fenced blocks (a `](` in code is not a link)."""
    return re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, - for spaces."""
    found = set()
    for line in _prose(page.read_text(encoding="utf-8")).splitlines():
        if match := re.match(r"^#{1,6} (.*)$", line):
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            found.add(slug)
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path_text, _, anchor = target.partition("#")
        path = (page.parent / path_text).resolve() if path_text else page
        if not path.exists() or (ROOT not in path.parents and path != ROOT):
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_no_page_names_a_document_that_does_not_ship() -> None:
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"\b([A-Z][A-Z-]+\.md)\b", page.read_text(encoding="utf-8")))
    shipped = {path.name for path in ROOT.rglob("*.md")
               if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)}
    assert named - shipped == set()
