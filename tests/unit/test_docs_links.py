"""Links that hold: every relative link and anchor in the README, CONTRIBUTING and docs/ resolves, and every
README or docs section that the code names (the verdict's advice, error lines, help texts, comments) exists.

Anchors follow GitHub's rule: the heading lowercased, punctuation but `-` and `_` dropped, spaces as `-`,
a repeated heading suffixed -1, -2, ..."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "launch" / "README.md",
                REPO / "examples" / "families" / "README.md", *(REPO / "docs").rglob("*.md")])
# where the code points users (and readers) at a README or docs section
SOURCES = sorted([*(REPO / "src" / "zcvae").rglob("*.py"), *(REPO / "src" / "zcvae").rglob("*.yaml"),
                  *(REPO / "src" / "zcvae").rglob("*.sbatch"), *(REPO / "bench").glob("*.py"),
                  *(REPO / "launch").rglob("*.yaml"), REPO / "launch" / "README.md"])

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (links there are examples, not links)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        lines.append("" if fenced else re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def _headings(path: Path) -> list[str]:
    out, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} +(.+?) *#*$", line)):
            out.append(m.group(1))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in _headings(path):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    out |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", path.read_text()))
    return out


def _title(text: str) -> str:
    """A section title as prose quotes it: no backticks, no markdown link syntax, spaces collapsed."""
    return " ".join(re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "").split()).lower()


def _resolve(page: Path, target: str) -> str | None:
    """None when ``target`` (a relative link from ``page``) resolves, else why not."""
    path_part, _, anchor = target.partition("#")
    dest = (page.parent / path_part).resolve() if path_part else page
    if not dest.exists():
        return f"{path_part} does not exist"
    if anchor:
        if dest.suffix != ".md":
            return f"an anchor into {path_part}, which is not markdown"
        if anchor not in anchors(dest):
            return f"no heading with the anchor #{anchor} in {dest.relative_to(REPO)}"
    return None


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text()))
            if not re.match(r"[a-z][a-z0-9+.-]*:", t)]  # http:, https:, mailto: are not checked here


def test_the_pages_exist_and_hold_links():
    assert all(p.is_file() for p in PAGES)
    assert len(_relative_links(REPO / "README.md")) >= 10


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    broken = [f"{t}: {why}" for t in _relative_links(page) if (why := _resolve(page, t))]
    assert not broken, f"{page.relative_to(REPO)}: " + "; ".join(broken)


# README, "Section" / the README's "Section" / README.md#anchor
README_SECTION = re.compile(r"README(?:\.md)?(?:'s)?,?\s+\"([^\"]+)\"")
README_ANCHOR = re.compile(r"README\.md#([\w-]+)")
# docs/PATH, docs/PATH#anchor or docs/PATH, "Section"
DOCS_REF = re.compile(r"(docs/[\w./-]*[\w/])(#[\w-]+)?(?:,\s+\"([^\"]+)\")?")


def _code_references(source: Path) -> list[tuple[str, str | None, str | None]]:
    """(page relative to the repository, anchor, quoted section title) for each README or docs reference."""
    text = source.read_text()
    refs: list[tuple[str, str | None, str | None]] = []
    refs += [("README.md", None, m) for m in README_SECTION.findall(text)]
    refs += [("README.md", m, None) for m in README_ANCHOR.findall(text)]
    refs += [(path, anchor.lstrip("#") or None, title or None) for path, anchor, title in DOCS_REF.findall(text)]
    return refs


def test_the_code_names_docs_sections():
    # the scan finds what it should: the verdict's and the presets' pointers into docs/
    refs = {path for source in SOURCES for path, _, _ in _code_references(source)}
    assert {"docs/objective.md", "docs/results/default.md", "docs/guide/verdict.md"} <= refs


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_readme_or_docs_section_the_code_names_exists(source):
    broken = []
    for path, anchor, title in _code_references(source):
        dest = REPO / path
        if not dest.exists():
            broken.append(f"{path} does not exist")
        elif anchor and anchor not in anchors(dest):
            broken.append(f"{path}#{anchor}: no such heading")
        elif title and _title(title) not in {_title(h) for h in _headings(dest)}:
            broken.append(f'{path}, "{title}": no such section')
    assert not broken, f"{source.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_is_a_short_guide_with_the_commands_ci_runs():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    ci = (REPO / ".ci" / "run").read_text()
    (command,) = [line for line in ci.splitlines() if line.startswith("python -m pip install")]
    assert command in readme.splitlines(), "the README's test command is the one .ci/run runs"
    # results live in docs/results/, each with its revision; no table row in the README names a git revision
    assert not [line for line in readme.splitlines() if line.startswith("|") and re.search(r"\bgit\b|\b[0-9a-f]{7,40}\b", line)]
    assert "### The memory plan" in readme


def test_slug_follows_github():
    assert slug("The posterior gradient (`--grad-probe-every`)") == "the-posterior-gradient---grad-probe-every"
    assert slug("Data a user brings: `late` and `ambiguous` (K = 3, JSONL)") == "data-a-user-brings-late-and-ambiguous-k--3-jsonl"
