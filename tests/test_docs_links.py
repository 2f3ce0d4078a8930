"""Every relative link in README.md and docs/*.md resolves: the file exists and, for
`path#anchor` or `#anchor`, the heading exists in it, slugged as GitHub slugs headings.
Absolute links (http, https, mailto) are not checked: the tests have no network."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)
ABSOLUTE = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose(markdown: str) -> str:
    """The text links and headings can live in: fenced blocks and code spans blanked."""
    return CODE_SPAN.sub("", FENCE.sub("", markdown))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text (link targets dropped), lowercased, every
    character but letters, digits, `_`, `-` and spaces dropped, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    found = set()
    for match in HEADING.finditer(FENCE.sub("", page.read_text())):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path) -> list[str]:
    """The relative links of a page that name no file, or no heading of their file."""
    broken = []
    for match in LINK.finditer(prose(page.read_text())):
        target = match.group(1)
        if ABSOLUTE.match(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading #{anchor} in {linked.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


def test_the_readme_links_every_docs_page() -> None:
    """The README is the way in: a page it does not link is a page nobody finds."""
    linked = {
        (ROOT / match.group(1).partition("#")[0]).resolve()
        for match in LINK.finditer(prose((ROOT / "README.md").read_text()))
        if not ABSOLUTE.match(match.group(1))
    }
    unlinked = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert unlinked == []


def test_the_readme_stays_a_five_minute_read() -> None:
    """Issue 55: the README is at most about 250 lines; the rest lives in docs/ pages."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


def test_slugs_follow_githubs_rules() -> None:
    assert slug("Sleep mode (`--enable-sleep-mode`)") == "sleep-mode---enable-sleep-mode"
    assert slug("Prefill/decode disaggregation") == "prefilldecode-disaggregation"
    assert slug("Several samples (`n > 1`)") == "several-samples-n--1"
    assert slug("Tenants and `--scheduling-policy fair`") == "tenants-and---scheduling-policy-fair"
    assert slug("See [the table](x.md#t)") == "see-the-table"


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    """The check fails on what it must fail on, and passes what resolves."""
    (tmp_path / "other.md").write_text("# Other page\n\n## A (`b`) c\n\n## A (`b`) c\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Here\n\n"
        "[ok](other.md) [ok](other.md#other-page) [ok](other.md#a-b-c-1) [ok](#here)\n"
        "![ok](other.md) [web](https://example.com/missing.md) `[code](missing.md)`\n"
        "```\n[fenced](missing.md)\n```\n"
        "[file](missing.md) [anchor](other.md#nowhere) [self](#gone) [dup](other.md#a-b-c-2)\n"
    )
    assert broken_links(page) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        "other.md#nowhere: no heading #nowhere in other.md",
        "#gone: no heading #gone in page.md",
        "other.md#a-b-c-2: no heading #a-b-c-2 in other.md",
    ]
