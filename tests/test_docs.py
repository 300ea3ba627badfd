"""The documentation holds together: a short front door, links that resolve, no path outside the repository.

README.md is the front door (at most 300 lines); the reference lives in docs/. Every relative link of the
README, the docs pages and benchmarks/README.md must name a file of the repository (and, with a ``#fragment``
into a Markdown page, one of its headings, slugged as GitHub does). No tracked file may point at the project's
notes beside the repository, and no page may name this checkout's absolute path.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from benchmarks.common import update_readme_section

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 300
# Spelled in two parts so that this file does not match itself.
OUTSIDE_NOTES = "../" + "shared"

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target); an optional "title" after the target is dropped.
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+.*)?$")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


def doc_pages() -> list[Path]:
    """The pages whose links are checked."""
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [p for p in pages if p.is_file()]


def prose_lines(text: str, keep_code: bool = False) -> list[str]:
    """The lines outside fenced code blocks; inline code removed (code is not a link) unless `keep_code`."""
    out: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line if keep_code else INLINE_CODE.sub("", line))
    return out


def links(text: str) -> list[str]:
    """Every link target of a Markdown text (inline, image and reference-style), in order."""
    found: list[str] = []
    for line in prose_lines(text):
        found.extend(INLINE_LINK.findall(line))
        ref = REFERENCE_LINK.match(line)
        if ref:
            found.append(ref.group(1))
    return found


def is_external(target: str) -> bool:
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: rendered text, lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown page's headings (a repeated slug gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in prose_lines(text, keep_code=True):  # a heading's text includes its code spans
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """The relative links of `page` that name no file under `root`, or no heading of a page."""
    text = page.read_text(encoding="utf-8")
    bad: list[str] = []
    for target in links(text):
        if is_external(target):
            continue
        path_part, _, fragment = target.partition("#")
        dest = page if not path_part else (page.parent / path_part).resolve()
        if not dest.is_relative_to(root):
            bad.append(f"{target} (outside the repository)")
            continue
        if not dest.exists():
            bad.append(f"{target} (no such file)")
            continue
        if fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text(encoding="utf-8")):
            bad.append(f"{target} (no heading #{fragment} in {dest.relative_to(root)})")
    return bad


def tracked_files() -> list[Path]:
    """The files git tracks in this checkout (skips the test outside a git checkout)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout: {exc}")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_readme_is_a_front_door() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_docs_index_lists_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    listed = {Path(t).name for t in links(index) if not is_external(t)}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= listed, f"docs/README.md does not link {sorted(pages - listed)}"


@pytest.mark.parametrize("page", doc_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken_links(page) == [], f"{page.relative_to(ROOT)}: broken links"


def test_link_checker_catches_broken_links(tmp_path: Path) -> None:
    """The checker itself: a missing file, a missing heading and a path out of the tree are reported; links
    that resolve are not, and code (fenced or inline) holds no links."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## The `x` flag, again\n", encoding="utf-8")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Title\n\n[ok](#title) [ok](other.md#the-x-flag-again) [gone](no_such_page.md)\n"
        "[bad anchor](other.md#no-such-heading) ![up](../../outside.png) [web](https://example.com/a.md)\n"
        "`[in code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "no_such_page.md (no such file)",
        "other.md#no-such-heading (no heading #no-such-heading in docs/other.md)",
        "../../outside.png (outside the repository)",
    ]
    assert slug("Model `tiny` — 2026-11-29, 2 CPU cores") == "model-tiny--2026-11-29-2-cpu-cores"
    assert anchors("# A\n\n# A\n") == {"a", "a-1"}


def test_no_reference_to_the_notes_outside_the_repository() -> None:
    offenders: list[str] = []
    for path in tracked_files():
        if not path.is_file():
            continue  # deleted in the work tree, not yet in the index
        data = path.read_bytes()
        if OUTSIDE_NOTES.encode() not in data:
            continue
        lines = data.decode("utf-8", errors="replace").splitlines()
        for n, line in enumerate(lines, 1):
            in_test_assertion = path.parent == ROOT / "tests" and "assert" in line
            if OUTSIDE_NOTES in line and not in_test_assertion:
                offenders.append(f"{path.relative_to(ROOT)}:{n}")
    assert offenders == [], f"{OUTSIDE_NOTES} referenced at {offenders}"


def test_pages_name_no_machine_path() -> None:
    # The checkout's path and the folder holding it, unless that is a shared scratch folder (a clone in
    # /tmp would otherwise flag the docs' example `--out /tmp/x.json` arguments).
    machine = [str(ROOT)] + ([str(ROOT.parent) + "/"] if str(ROOT.parent) not in ("/", "/tmp") else [])
    for page in doc_pages():
        text = page.read_text(encoding="utf-8")
        assert not any(p in text for p in machine), f"{page.relative_to(ROOT)} names this machine's path"


def test_benchmark_tables_land_in_docs_with_working_image_links(tmp_path: Path) -> None:
    """`--readme` rewrites a marked section of docs/benchmarks.md; image links are rebased onto docs/."""
    page = tmp_path / "benchmarks.md"
    page.write_text("intro\n\n<!-- probe:begin -->\nold\n<!-- probe:end -->\n\nafter\n", encoding="utf-8")
    update_readme_section("probe", "| a |\n|---|\n\n![plot](results/cpu_speed.png)", readme=page)
    text = page.read_text(encoding="utf-8")
    assert "old" not in text and "after" in text
    assert "![plot](../benchmarks/results/cpu_speed.png)" in text
    docs_page = ROOT / "docs" / "benchmarks.md"
    for name in re.findall(r"<!-- (\w+):begin -->", docs_page.read_text(encoding="utf-8")):
        assert f"<!-- {name}:end -->" in docs_page.read_text(encoding="utf-8"), f"marker {name} not closed"
