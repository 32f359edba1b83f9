"""The docs hold together: the README's size, every relative link and anchor, every page reachable.

Reads the markdown files only (no qkit import): fast. Anchors follow GitHub's slugs: the heading's text
without its markdown (code spans, links, emphasis), lowercased, every character that is not a letter, a
digit, a space, '-' or '_' dropped, spaces turned into '-', and '-1', '-2', ... after a repeated slug.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
INDEX = DOCS / "README.md"
README_MAX_BYTES = 12_000

FENCE = re.compile(r"^(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(CODE_SPAN.sub(" ", line))
    return out


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "")
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every relative link and same-page anchor in the page's prose."""
    found = []
    text = path.read_text(encoding="utf-8")
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in LINK.finditer(CODE_SPAN.sub(" ", line)):
            target = m.group(1)
            if not EXTERNAL.match(target):
                found.append((number, target))
    return found


def resolve(page: Path, target: str) -> tuple[Path, str]:
    file_part, _, anchor = target.partition("#")
    dest = (page.parent / unquote(file_part)).resolve() if file_part else page
    return dest, unquote(anchor)


def test_readme_is_at_most_12_kb():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes, over {README_MAX_BYTES:,}: move detail into docs/"


def test_readme_keeps_its_quickstart_block():
    text = README.read_text(encoding="utf-8")
    block = text.split("<!-- quickstart:begin -->", 1)[1].split("<!-- quickstart:end -->", 1)[0]
    commands = [line for line in block.splitlines() if re.match(r"^(pip|python|qkit|pytest) ", line)]
    assert len(commands) == 2, commands  # .ci/run runs exactly these two lines


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_exists(page: Path):
    broken = []
    cache: dict[Path, set[str]] = {}
    for number, target in links(page):
        dest, anchor = resolve(page, target)
        where = f"{page.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            broken.append(f"{where} (no such file)")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                broken.append(f"{where} (an anchor into a file that is not markdown)")
                continue
            if dest not in cache:
                cache[dest] = anchors(dest)
            if anchor not in cache[dest]:
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_reachable_from_the_index():
    reached, todo = {INDEX.resolve()}, [INDEX.resolve()]
    while todo:
        page = todo.pop()
        for _, target in links(page):
            dest, _ = resolve(page, target)
            if dest.suffix == ".md" and dest.is_file() and DOCS in dest.parents and dest not in reached:
                reached.add(dest)
                todo.append(dest)
    unreached = sorted(str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p.resolve() not in reached)
    assert not unreached, f"pages no link from docs/README.md leads to: {unreached}"


def test_slug_follows_github():
    assert slug("`qkit eval`: the quality table") == "qkit-eval-the-quality-table"
    assert slug("Priced for GPTQ: `--method gptq`") == "priced-for-gptq---method-gptq"
    assert slug("A GGUF file as it is: `file:PATH.gguf`") == "a-gguf-file-as-it-is-filepathgguf"
    assert slug("Whole files: `token_embd` and `output`") == "whole-files-token_embd-and-output"
    assert slug("The solver: exact for its objective") == "the-solver-exact-for-its-objective"
