"""Every relative link and #anchor in README.md and docs/ leads somewhere.

The front page and the docs tree link to each other by file and heading; a moved page or a renamed heading
breaks those links silently on GitHub. This reads the Markdown itself (no subprocess, no network): each
inline link ``[text](target)``, reference definition ``[name]: target`` and ``<img src>`` / ``<a href>``
outside code, resolved against the linking file's folder, must name a file or folder of the repository,
and its ``#anchor``, where the target is Markdown, a heading there by GitHub's slug rules (lowercase; spaces
to ``-``; punctuation other than ``-`` and ``_`` dropped; the second heading with the same slug gets ``-1``,
the third ``-2``) or an explicit ``<a id=...>`` / ``<a name=...>``. External links (``https:``, ``mailto:``)
are not followed: the suite is offline.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
# [text](target "title"), ![alt](target): the target up to whitespace or the closing parenthesis; one level of
# nested parentheses is allowed in the target (GitHub allows balanced ones).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?((?:[^()\s<>]|\([^()\s]*\))*)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_TARGET = re.compile(r"<(?:a|img)\b[^>]*?\b(?:href|src)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
HTML_ANCHOR = re.compile(r"<a\b[^>]*?\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def documents(root: Path = ROOT) -> list[Path]:
    """The Markdown a reader reaches from the front page: README.md, deploy/README.md and every page under docs/."""
    deploy = [root / "deploy" / "README.md"] if (root / "deploy" / "README.md").exists() else []
    return [root / "README.md", *deploy, *sorted((root / "docs").rglob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with inline code spans blanked out."""
    return [(number, CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line)) for number, line in outside_fences(text)]


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks."""
    lines, fence = [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = FENCE.match(line)
        if fence is not None:
            if opened and opened.group(1)[0] == fence[0] and len(opened.group(1)) >= len(fence):
                fence = None
            continue
        if opened:
            fence = opened.group(1)
            continue
        lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text, lowercase, spaces to '-', punctuation dropped."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's or image's text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and '_' (Unicode letters too, as GitHub)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a Markdown page offers: its headings' slugs (numbered when repeated) and explicit ids."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for _, line in outside_fences(text):
        found.update(HTML_ANCHOR.findall(line))
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every link and image in the page's prose."""
    found = []
    for number, line in prose_lines(text):
        reference = REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
            continue
        found += [(number, target) for target in INLINE_LINK.findall(line)]
        found += [(number, target) for target in HTML_TARGET.findall(line)]
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """One line per link of ``page`` that leads nowhere: 'page:line: target: why'."""
    problems = []
    text = page.read_text(encoding="utf-8")
    where = page.relative_to(root)
    for number, target in links(text):
        if not target or EXTERNAL.match(target) or target.startswith("//"):
            continue
        path, _, anchor = target.partition("#")
        path = path.split("?", 1)[0]
        if path.startswith("/"):
            problems.append(f"{where}:{number}: {target}: an absolute path (GitHub resolves it against the site)")
            continue
        file = (page.parent / path).resolve() if path else page
        try:
            file.relative_to(root.resolve())
        except ValueError:
            problems.append(f"{where}:{number}: {target}: outside the repository")
            continue
        if not file.exists():
            problems.append(f"{where}:{number}: {target}: no such file")
            continue
        if anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            shown = file.relative_to(root.resolve())
            problems.append(f"{where}:{number}: {target}: no heading or id '{anchor}' in {shown}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# the checker itself: it can fail


def test_slugs_follow_githubs_rules():
    assert slug("Two commands") == "two-commands"
    assert slug("FP8 kept as FP8: `--dtype float8_e4m3fn`") == "fp8-kept-as-fp8---dtype-float8_e4m3fn"
    assert slug("One model over N workers: `--partition I/N`, then `--finalize N`") == \
        "one-model-over-n-workers---partition-in-then---finalize-n"
    assert slug("Straight to the Hub: `export CKPT hf://ORG/REPO[@BRANCH]`") == \
        "straight-to-the-hub-export-ckpt-hforgrepobranch"
    assert slug("[The report](report.md) and **its** fields") == "the-report-and-its-fields"
    page = "# Title\n## Usage\n```\n## not a heading\n```\n## Usage\n## Usage\n<a id=\"kept\"></a>\n"
    assert anchors(page) == {"title", "usage", "usage-1", "usage-2", "kept"}


def test_the_checker_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Its part\n")
    (tmp_path / "README.md").write_text(
        "# Front\n\n"
        "[fine](docs/page.md) [fine too](docs/page.md#its-part) [here](#front) ![img](docs)\n"
        "[gone](docs/missing.md) [no part](docs/page.md#another-part) [not here](#nowhere)\n"
        "`[in code](docs/missing-in-code.md)` [web](https://example.com/x.md#y)\n"
        "```\n[in a fence](docs/missing-in-fence.md)\n```\n"
        "[ref]: docs/missing-ref.md\n"
        '<img src="docs/missing.png" width="10">\n'
    )
    assert broken_links(tmp_path / "README.md", tmp_path) == [
        "README.md:4: docs/missing.md: no such file",
        "README.md:4: docs/page.md#another-part: no heading or id 'another-part' in docs/page.md",
        "README.md:4: #nowhere: no heading or id 'nowhere' in README.md",
        "README.md:9: docs/missing-ref.md: no such file",
        "README.md:10: docs/missing.png: no such file",
    ]
    assert documents(tmp_path) == [tmp_path / "README.md", tmp_path / "docs" / "page.md"]


# ---------------------------------------------------------------------------------------------------------------
# the real pages


@pytest.mark.parametrize("page", documents(), ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_resolves(page):
    assert broken_links(page) == []


def test_the_front_page_stays_short():
    """README.md is read in five minutes (issue 40: at most 250 lines); detail belongs in a page under docs/."""
    lines = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move detail into docs/"


def test_the_docs_are_reachable_from_the_front_page():
    """Every page under docs/ (outside the bench results, which their own index lists) is linked from
    README.md or from the docs' table of contents, so no page is written that nobody can find."""
    linked = set()
    for page in (ROOT / "README.md", ROOT / "docs" / "README.md"):
        for _, target in links(page.read_text(encoding="utf-8")):
            if not EXTERNAL.match(target) and target.partition("#")[0]:
                linked.add((page.parent / target.partition("#")[0]).resolve())
    orphans = [str(page.relative_to(ROOT)) for page in documents()
               if page.resolve() not in linked and page.name != "README.md" and "bench" not in page.parts]
    assert orphans == []


# ---------------------------------------------------------------------------------------------------------------
# the command-line reference keeps step with the parser (tests/test_cli_messages.py checks --help's defaults)

BULLET_OPTIONS = re.compile(r"^- ((?:`--[a-z0-9-]+[^`]*`(?: / |, | \(|\)|:| or )*)+)")


def cli_sections(text: str) -> dict[str, str]:
    """docs/cli.md's '## `ckptconv NAME`' sections by command name."""
    parts = re.split(r"^## `ckptconv ([a-z-]+)`\s*$", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_cli_reference_names_every_option_of_every_command():
    """Each command has its section in docs/cli.md naming each of its options, and each option a bullet there
    starts with is one the command has: an option added, renamed or dropped in ckptconv/cli.py shows here."""
    import argparse

    from ckptconv import cli

    sections = cli_sections((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    commands = next(a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    problems = [f"no section '## `ckptconv {name}`'" for name in commands if name not in sections]
    problems += [f"a section for '{name}', which is no command" for name in sections if name not in commands]
    for name, command in commands.items():
        text = sections.get(name, "")
        options = {option for action in command._actions for option in action.option_strings
                   if option.startswith("--") and option != "--help"}
        problems += [f"{name}: {option} not in its section" for option in sorted(options)
                     if not re.search(rf"`{re.escape(option)}(?![a-z0-9-])", text)]
        for line in text.splitlines():
            head = BULLET_OPTIONS.match(line)
            if head:
                problems += [f"{name}: its section describes {option}, which it does not take"
                             for option in re.findall(r"`(--[a-z0-9-]+)", head.group(1)) if option not in options]
    assert problems == []
