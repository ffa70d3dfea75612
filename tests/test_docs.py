"""The docs stay readable and their pointers hold: docs/ARCHITECTURE.md is a ten-minute map, every
link of the README and docs/ reaches a file and heading, and every repository path that a doc or
a code comment names exists (pages move: docs/architecture/ took ARCHITECTURE.md's details), and
docs/ states the present within a word budget (PERFORMANCE.md's figures included; history is git's)."""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
MAP_MAX_WORDS = 2000  # ten minutes at 200 words a minute
PERFORMANCE_MAX_WORDS = 2500  # the current figures, their limits and how to take them; history is git's
DOCS_MAX_WORDS = 28_000  # docs/ state the present: 25,508 words once the logbook left (31,772 before; issue 76), + 10%
TOP_DIRS = ("bench", "docs", "examples", "packaging", "pipelines", "scripts", "sparsecore", "tests", "torch_tpu",
            "torchrec_tpu", "tpu_facts", "xla_cache")
SOURCES = [path for top in TOP_DIRS if top != "docs" for path in sorted((REPO_ROOT / top).rglob("*.py"))]


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-")


def test_the_architecture_map_is_a_ten_minute_read() -> None:
    assert len((REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text().split()) <= MAP_MAX_WORDS


def test_the_performance_page_states_the_present() -> None:
    assert len((REPO_ROOT / "docs" / "PERFORMANCE.md").read_text().split()) <= PERFORMANCE_MAX_WORDS


def test_the_docs_stay_within_their_word_budget() -> None:
    words = sum(len(page.read_text().split()) for page in (REPO_ROOT / "docs").rglob("*.md"))
    assert words <= DOCS_MAX_WORDS, f"docs/ holds {words} words, over {DOCS_MAX_WORDS}: cut what no longer holds"


def test_links_point_at_files_and_headings() -> None:
    broken = []
    for page in PAGES:
        for path, anchor in re.findall(r"\]\(([^)#:]+)(?:#([\w-]+))?\)", page.read_text()):
            target = (page.parent / path).resolve()
            if not target.exists():
                broken.append(f"{page.relative_to(REPO_ROOT)}: {path}")
            elif anchor and anchor not in {_slug(h) for h in re.findall(r"^#+ (.+)$", target.read_text(), flags=re.M)}:
                broken.append(f"{page.relative_to(REPO_ROOT)}: {path}#{anchor}")
    assert not broken, "\n".join(broken)


def test_the_repository_paths_the_docs_name_exist() -> None:
    pattern = re.compile(rf"`((?:{'|'.join(TOP_DIRS)})/[\w./-]*)`")
    missing = [f"{page.relative_to(REPO_ROOT)}: {path}" for page in PAGES for path in pattern.findall(page.read_text())
               if not (REPO_ROOT / path).exists()]
    assert not missing, "\n".join(missing)


def test_the_docs_code_points_at_exist() -> None:
    missing = [f"{source.relative_to(REPO_ROOT)}: {doc}" for source in SOURCES
               for doc in re.findall(r"\bdocs/[\w/]+\.md\b", source.read_text()) if not (REPO_ROOT / doc).is_file()]
    assert not missing, "\n".join(missing)
