"""Every ``docs/math/<page>.md#<anchor>`` reference resolves, and the mathematics ships with the project.

Docstrings (and the README, ``ARCHITECTURE.md`` and the tutorials) point to the derivation of what
they compute as ``docs/math/<page>.md#<anchor>``, ``<anchor>`` being the GitHub-style slug of a
heading of that page. A renamed heading or page breaks such a reference silently, so this test
resolves every one of them, and every relative link between the pages. It also fails if anything
mentions the unshipped notes the pages replaced (``FORBIDDEN``), which would be a reference that
cannot resolve for a user.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MATH = ROOT / "docs" / "math"

# The unshipped sources the pages were written from; no shipped file may point at them.
FORBIDDEN = ("MATH.md", "shared/papers")

# ``docs/math/smc.md#sinkhorn-in-the-log-domain``; the anchor is optional (a page reference).
_REFERENCE = re.compile(r"docs/math/([\w.-]+?\.md)(?:#([\w-]*))?")
# Markdown links between the pages: ``[text](ep.md#power-ep)``, ``[text](#damping)``.
_LINK = re.compile(r"\]\(([^)\s]*)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than ``-`` and ``_`` dropped,
    spaces turned into hyphens (inline code and emphasis markers are punctuation too)."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """The anchors of every heading outside code fences, duplicates numbered ``-1``, ``-2``, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in markdown.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        match = None if fenced else _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def source_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The files whose ``docs/math`` references must resolve."""
    files = sorted((root / "pyro_smc").rglob("*.py"))
    files += [root / name for name in ("README.md", "ARCHITECTURE.md") if (root / name).exists()]
    files += sorted((root / "tutorials").glob("*.ipynb"))
    return files


def broken_references(root: pathlib.Path) -> list[str]:
    """Every reference in :func:`source_files` and every relative link in ``docs/math`` that does not
    resolve, as ``"file: reference (why)"``."""
    math_dir = root / "docs" / "math"
    cache: dict[pathlib.Path, set[str] | None] = {}

    def page_anchors(page: pathlib.Path) -> set[str] | None:
        if page not in cache:
            cache[page] = anchors(page.read_text(encoding="utf-8")) if page.is_file() else None
        return cache[page]

    def check(where: pathlib.Path, page: pathlib.Path, anchor: str | None, shown: str, problems: list[str]) -> None:
        found = page_anchors(page)
        rel = where.relative_to(root)
        if found is None:
            problems.append(f"{rel}: {shown} (no page {page.relative_to(root)})")
        elif anchor is not None and anchor not in found:
            problems.append(f"{rel}: {shown} (no heading with anchor #{anchor}; the page has {sorted(found)})")

    problems: list[str] = []
    for path in source_files(root):
        for match in _REFERENCE.finditer(path.read_text(encoding="utf-8")):
            anchor = match.group(2)
            if anchor == "":
                problems.append(f"{path.relative_to(root)}: {match.group(0)} (empty anchor)")
                continue
            check(path, math_dir / match.group(1), anchor, match.group(0), problems)
    for page in sorted(math_dir.glob("*.md")):
        for match in _LINK.finditer(page.read_text(encoding="utf-8")):
            target = match.group(1)
            if re.match(r"^[a-z]+:", target):
                continue  # an external URL
            name, _, anchor = target.partition("#")
            check(page, page.parent / name if name else page, anchor or None, target, problems)
    return problems


def forbidden_mentions(root: pathlib.Path, skip: pathlib.Path | None = None) -> list[str]:
    """Files of the package, tests, tutorials, README, ARCHITECTURE.md and docs that name a ``FORBIDDEN`` source."""
    files = list((root / "pyro_smc").rglob("*.py")) + list((root / "tests").rglob("*.py"))
    files += list((root / "tutorials").glob("*.ipynb")) + list((root / "docs").rglob("*.md"))
    files += [root / name for name in ("README.md", "ARCHITECTURE.md") if (root / name).exists()]
    hits = []
    for path in sorted(set(files)):
        if skip is not None and path.resolve() == skip.resolve():
            continue
        text = path.read_text(encoding="utf-8")
        for word in FORBIDDEN:
            if word in text:
                line = text[: text.index(word)].count("\n") + 1
                hits.append(f"{path.relative_to(root)}:{line} mentions {word}")
    return hits


def test_math_pages_exist_and_index_links_every_page():
    pages = {p.name for p in MATH.glob("*.md")}
    assert {"index.md", "smc.md", "ep.md", "kronecker.md", "streaming.md"} <= pages
    index = (MATH / "index.md").read_text(encoding="utf-8")
    linked = {m.group(1).partition("#")[0] for m in _LINK.finditer(index)}
    assert pages - {"index.md"} <= linked, f"docs/math/index.md does not link {sorted(pages - {'index.md'} - linked)}"


def test_every_math_reference_resolves():
    assert broken_references(ROOT) == []


def test_the_package_cites_the_math_pages():
    # A reference pattern that matched nothing would make the test above pass vacuously.
    cited = {m.group(1) for path in source_files(ROOT) for m in _REFERENCE.finditer(path.read_text(encoding="utf-8"))}
    assert {"smc.md", "ep.md", "kronecker.md", "streaming.md"} <= cited, cited


def test_nothing_points_at_unshipped_sources():
    assert forbidden_mentions(ROOT, skip=pathlib.Path(__file__)) == []


@pytest.mark.parametrize(
    "heading, anchor",
    [
        ("Sinkhorn in the log domain", "sinkhorn-in-the-log-domain"),
        ("K-Diag", "k-diag"),
        ("Exact moments of a GP at a Gaussian input", "exact-moments-of-a-gp-at-a-gaussian-input"),
        ("The `MatrixNormal` (vec, kron)", "the-matrixnormal-vec-kron"),
        ("Power EP: alpha_i", "power-ep-alpha_i"),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_the_checks_fail_on_broken_references(tmp_path):
    """The checker is not vacuous: a missing page, a missing anchor, a bad link and a forbidden
    mention are each reported, and a good reference is not."""
    (tmp_path / "docs" / "math").mkdir(parents=True)
    (tmp_path / "pyro_smc").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tutorials").mkdir()
    (tmp_path / "docs" / "math" / "smc.md").write_text(
        "# SMC\n\n## Sinkhorn\n\n```text\n## Not a heading\n```\n\n## Sinkhorn\n\nSee [x](ep.md#none) and [y](#sinkhorn-1).\n"
    )
    (tmp_path / "pyro_smc" / "good.py").write_text('"""See ``docs/math/smc.md#sinkhorn`` and ``docs/math/smc.md#sinkhorn-1``."""\n')
    (tmp_path / "pyro_smc" / "bad.py").write_text(
        '"""See ``docs/math/smc.md#sinkhorn-scaling``, ``docs/math/kalman.md#update`` and ``docs/math/smc.md#not-a-heading``."""\n'
    )
    (tmp_path / "README.md").write_text("The derivations are in MATH" + ".md.\n")
    problems = broken_references(tmp_path)
    assert len(problems) == 4, problems
    assert any("#sinkhorn-scaling" in p for p in problems)
    assert any("no page docs/math/kalman.md" in p for p in problems)
    assert any("#not-a-heading" in p for p in problems)  # headings inside code fences do not count
    assert any("no page docs/math/ep.md" in p for p in problems)
    assert not any("good.py" in p for p in problems)
    assert forbidden_mentions(tmp_path) == ["README.md:1 mentions " + "MATH" + ".md"]
