"""The README and docs/ stand alone: every relative link resolves inside the project.

A clone or an sdist holds only this repository, so a link that climbs out of it
(``../shared/...``) or names a missing page is broken for every reader.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    targets = [m[1].split("#")[0] for m in LINK.finditer(page.read_text())]
    return [t for t in targets if t and not re.match(r"[a-z][a-z+.-]*:", t)]


def test_every_relative_link_resolves_inside_the_project() -> None:
    broken = []
    for page in PAGES:
        for target in relative_links(page):
            path = (page.parent / target).resolve()
            if not path.is_relative_to(ROOT) or not path.exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_architecture_page_is_in_docs_and_the_readme_links_it() -> None:
    assert "docs/architecture.md" in relative_links(ROOT / "README.md")
    assert (ROOT / "docs" / "architecture.md").is_file()
    assert not (ROOT / "ARCHITECTURE.md").exists()
