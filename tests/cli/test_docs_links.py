"""The docs point at things that exist.

For README.md, BENCHMARKS.md and every docs/*.md:

- every relative link (``[text](path)``, ``[text](path#anchor)``, ``[ref]: path``) names a file
  or folder of the repository, relative to the document (``http(s):``, ``mailto:`` and other
  URLs with a scheme are not checked);
- every ``#anchor`` of a link into a Markdown file (the document itself included) names one of
  that file's headings, slugged as GitHub does;
- every ``make <target>`` the docs name in backticks or in a code block is a target of the
  Makefile.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

import pytest


def repo_root(start: Path) -> Path:
    """The nearest folder at or above ``start`` holding pyproject.toml (the test may move)."""
    for folder in (start, *start.parents):
        if (folder / "pyproject.toml").is_file():
            return folder
    raise RuntimeError(f"expected a pyproject.toml at or above {start}, found none")


ROOT = repo_root(Path(__file__).resolve().parent)


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").glob("*.md"))]


# ------------------------------------------------------------------------------------------------
# Markdown, as far as links, headings and code go
# ------------------------------------------------------------------------------------------------
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]"  # [text], one level of brackets inside
    r"\(\s*(<[^>]*>|[^)\s]+)"  # (target or (<target>
    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)"  # optional title
)
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
_ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
_MAKE = re.compile(
    r"(?<![\w./-])make\s+"
    r"(?:(?:[A-Za-z_][A-Za-z0-9_]*=\S*|-\S+)\s+)*"  # VAR=value and -flags before the target
    r"([A-Za-z0-9][A-Za-z0-9_.-]*)"
)


@dataclass(frozen=True, slots=True)
class Doc:
    """A Markdown document split into its prose (code spans blanked) and its code."""

    path: Path
    prose: str
    code: list[str]  # fenced blocks and inline code spans
    headings: list[str]  # heading texts, in order

    @classmethod
    def read(cls, path: Path) -> Doc:
        prose_lines: list[str] = []
        code: list[str] = []
        block: list[str] | None = None
        fence = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            m = _FENCE.match(line)
            if block is None and m:
                block, fence = [], m.group(1)
                prose_lines.append("")
            elif block is not None:
                closing = line.strip()
                if closing.startswith(fence) and not closing.strip(fence[0]):
                    code.append("\n".join(block))
                    block = None
                else:
                    block.append(line)
                prose_lines.append("")
            else:
                prose_lines.append(line)
        if block is not None:
            code.append("\n".join(block))
        text = "\n".join(prose_lines)
        code.extend(m.group(2) for m in _CODE_SPAN.finditer(text))
        prose = _CODE_SPAN.sub(lambda m: " " * len(m.group(0)), text)
        return cls(path=path, prose=prose, code=code, headings=_headings(prose))

    def link_targets(self) -> list[str]:
        found = [m.group(1) for m in _INLINE_LINK.finditer(self.prose)]
        found += [m.group(1) for m in _REFERENCE_DEF.finditer(self.prose)]
        return [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in found]

    def anchors(self) -> set[str]:
        return set(github_slugs(self.headings)) | set(_HTML_ANCHOR.findall(self.prose))

    def make_targets(self) -> list[str]:
        return [m.group(1) for chunk in self.code for m in _MAKE.finditer(chunk)]


def _headings(prose: str) -> list[str]:
    lines = prose.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        m = _ATX_HEADING.match(line)
        if m:
            out.append(m.group(2))
        elif (
            i > 0
            and _SETEXT_UNDERLINE.match(line)
            and lines[i - 1].strip()
            and not lines[i - 1].lstrip().startswith(("-", "*", "|", ">"))
            and not _ATX_HEADING.match(lines[i - 1])
        ):
            out.append(lines[i - 1].strip())
    return out


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text as rendered, lower case, punctuation but ``-`` and
    ``_`` dropped, each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def github_slugs(headings: list[str]) -> Iterator[str]:
    """Slugs in document order, repeats numbered ``-1``, ``-2`` … as GitHub numbers them."""
    seen: dict[str, int] = {}
    for heading in headings:
        slug = github_slug(heading)
        if slug in seen:
            seen[slug] += 1
            yield f"{slug}-{seen[slug]}"
        else:
            seen[slug] = 0
            yield slug


def makefile_targets(makefile: Path) -> set[str]:
    """Targets of ``target:`` rule lines and of ``.PHONY:``; variables (``X := y``) are not."""
    targets: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.][A-Za-z0-9_.\- ]*?)\s*::?(?!=)(.*)$", line)
        if not m:
            continue
        names, rest = m.group(1).split(), m.group(2)
        if names == [".PHONY"]:
            targets.update(rest.split())
        else:
            targets.update(n for n in names if not n.startswith("."))
    return targets


# ------------------------------------------------------------------------------------------------
# The checks: each returns its problems as "doc: what is wrong" lines
# ------------------------------------------------------------------------------------------------
def broken_links(doc_path: Path, root: Path) -> list[str]:
    doc = Doc.read(doc_path)
    rel = doc_path.relative_to(root)
    problems: list[str] = []
    for target in doc.link_targets():
        if _SCHEME.match(target):
            continue  # http:, https:, mailto: and other URLs
        path_part, _, anchor = target.partition("#")
        path_part = unquote(path_part)
        if not path_part:
            dest = doc_path
        elif path_part.startswith("/"):
            dest = root / path_part.lstrip("/")
        else:
            dest = doc_path.parent / path_part
        dest = dest.resolve()
        if not dest.is_relative_to(root):
            problems.append(f"{rel}: link {target!r} leaves the repository")
            continue
        if not dest.exists():
            problems.append(
                f"{rel}: link {target!r}: expected {dest.relative_to(root)} to exist, found nothing"
            )
            continue
        if anchor and dest.is_file() and dest.suffix == ".md":
            anchors = doc.anchors() if dest == doc_path.resolve() else Doc.read(dest).anchors()
            if unquote(anchor) not in anchors:
                problems.append(
                    f"{rel}: link {target!r}: expected a heading with anchor #{anchor} in "
                    f"{dest.relative_to(root)}, found {sorted(anchors)}"
                )
    return problems


def unknown_make_targets(doc_path: Path, root: Path) -> list[str]:
    known = makefile_targets(root / "Makefile")
    rel = doc_path.relative_to(root)
    return [
        f"{rel}: `make {t}`: expected a Makefile target, found none (targets: {sorted(known)})"
        for t in Doc.read(doc_path).make_targets()
        if t not in known
    ]


# ------------------------------------------------------------------------------------------------
# Tests
# ------------------------------------------------------------------------------------------------
DOCS = doc_files(ROOT)
DOC_IDS = [str(p.relative_to(ROOT)) for p in DOCS]


@pytest.mark.parametrize("doc_path", DOCS, ids=DOC_IDS)
def test_every_relative_link_and_anchor_of_the_doc_exists(doc_path: Path) -> None:
    assert broken_links(doc_path, ROOT) == []


@pytest.mark.parametrize("doc_path", DOCS, ids=DOC_IDS)
def test_every_make_target_the_doc_names_is_in_the_makefile(doc_path: Path) -> None:
    assert unknown_make_targets(doc_path, ROOT) == []


def test_the_readme_links_every_docs_file() -> None:
    docs = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert docs, "expected docs/*.md, found none"
    linked = {t.partition("#")[0] for t in Doc.read(ROOT / "README.md").link_targets()}
    assert [d for d in docs if f"docs/{d}" not in linked] == []


def test_the_readme_names_the_commands_a_newcomer_needs() -> None:
    targets = set(Doc.read(ROOT / "README.md").make_targets())
    assert {"demo", "test", "test-fast", "up"} <= targets


def test_github_slugs_drop_punctuation_keep_hyphens_and_number_repeats() -> None:
    headings = [
        "The controller's heavy work on a cluster",
        "The sink: `make bench-sink` and `make demo`",
        "From Spark (time travel)",
        "snake_case [link](x.md) & more",
        "Recovery",
        "Recovery",
    ]
    assert list(github_slugs(headings)) == [
        "the-controllers-heavy-work-on-a-cluster",
        "the-sink-make-bench-sink-and-make-demo",
        "from-spark-time-travel",
        "snake_case-link--more",
        "recovery",
        "recovery-1",
    ]


def test_makefile_targets_are_rules_and_phony_names_not_variables(tmp_path: Path) -> None:
    (tmp_path / "Makefile").write_text(
        ".PHONY: demo only-phony\nX := 1\nY ?= 2\nexport Z := 3\n$(STAMP): a\ndemo: $(STAMP)\n"
        "\techo not: a rule\nbench bench-all: demo\n"
    )
    assert makefile_targets(tmp_path / "Makefile") == {"demo", "only-phony", "bench", "bench-all"}


def test_the_checks_report_a_missing_file_a_missing_heading_and_an_unknown_target(
    tmp_path: Path,
) -> None:
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "Makefile").write_text(".PHONY: demo\ndemo:\n\techo\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other\n\n## Right heading\n")
    doc = tmp_path / "README.md"
    doc.write_text(
        "# Title\n\n## Part two\n\n"
        "[ok](docs/other.md#right-heading), [ok](#part-two), [ok](docs/), [web](https://x.org/y),\n"
        "[mail](mailto:a@b.c), [gone](docs/missing.md), [bad anchor](docs/other.md#wrong-heading),\n"
        "[self](#nowhere), `[not a link](nowhere.md)`, `make demo`, `make chaos ARGS=--quick`\n\n"
        "```\nmake demo  # ok\nmake ARGS=1 nosuch\n[in code](nowhere.md)\n```\n"
    )
    assert repo_root(tmp_path / "docs") == tmp_path
    problems = broken_links(doc, tmp_path)
    assert [p.split(":")[1].strip() for p in problems] == [
        "link 'docs/missing.md'",
        "link 'docs/other.md#wrong-heading'",
        "link '#nowhere'",
    ]
    assert "expected docs/missing.md to exist, found nothing" in problems[0]
    assert "expected a heading with anchor #wrong-heading in docs/other.md" in problems[1]
    unknown = unknown_make_targets(doc, tmp_path)
    assert sorted(p.split(":")[1].strip() for p in unknown) == [
        "`make chaos`",
        "`make nosuch`",
    ]
