"""The docs hold no dangling reference: every relative link of README.md, CHANGELOG.md and docs/*.md
reaches a file (and its anchor a heading), every repository path they name exists, and every
section they cite by name (`docs/engine.md, "Memory"`) is a heading of that file."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
# Where a section is cited by name: the docs, the notebook and the code's comments and docstrings.
CITING = DOCS + sorted((ROOT / "benchmarks").rglob("*.md")) + sorted(
    p for folder in ("hf_slideformer", "benchmarks", "tests", "examples", "triton_ops")
    for p in (ROOT / folder).rglob("*.py") if p.name != "test_docs.py")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:docs|benchmarks|examples|scripts|hf_slideformer|tests|triton_ops)/[\w./-]*\w)")
TOP_DOC = re.compile(r"(?<![\w./-])([A-Z][A-Z_]*)(?:\.md\b|'s figures| section \d)")  # README.md: at the root
SECTION = re.compile(r"((?:docs/\w+|benchmarks/NOTEBOOK|README|CHANGELOG)\.md)`?,? \(?\"([^\"]+)\"")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(path: Path) -> list[str]:
    """The Markdown headings of a file, outside code fences."""
    out, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            out.append(line.lstrip("#").strip())
    return out


def prose(path: Path) -> str:
    """A file's text without its code blocks (commands name paths made at run time)."""
    return re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)


def test_the_checks_find_what_they_look_for():
    assert slug("3. Accelerate") == "3-accelerate" and slug("The `slide` rows: 8B") == "the-slide-rows-8b"
    assert LINK.findall("see [the engine](docs/engine.md#memory) and [x](https://a.b)") == [
        "docs/engine.md#memory", "https://a.b"]
    assert PATH.findall("in `docs/engine.md` and benchmarks/configs/llama3-8b.json.") == [
        "docs/engine.md", "benchmarks/configs/llama3-8b.json"]
    assert SECTION.findall('(docs/benchmarks.md, "State on disk")') == [("docs/benchmarks.md", "State on disk")]
    assert TOP_DOC.findall("README.md, docs/engine.md, benchmarks/NOTEBOOK.md, PLAN section 2") == ["README", "PLAN"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in LINK.findall(prose(doc)):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in {slug(h) for h in headings(path)}:
            broken.append(target)
    assert not broken, f"{doc.name}: links that reach nothing: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_paths_exist(doc):
    missing = sorted({p for p in PATH.findall(prose(doc)) if not (ROOT / p.rstrip(".")).exists()})
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_cited_sections_exist():
    missing = []
    for doc in CITING:
        text = prose(doc) if doc.suffix == ".md" else doc.read_text(encoding="utf-8")
        missing += [f"{doc.relative_to(ROOT)}: {file}, \"{name}\"" for file, name in cited_sections(text)
                    if not has_section(ROOT / file, name)]
    assert not missing, "sections cited that do not exist:\n" + "\n".join(missing)


def test_cited_top_level_documents_exist():
    """A bare `NAME.md` (or "NAME section 6") in the docs or the code is a file at the repository's root."""
    missing = sorted({f"{doc.relative_to(ROOT)}: {name}" for doc in CITING
                      for name in TOP_DOC.findall(doc.read_text(encoding="utf-8"))
                      if not (ROOT / f"{name}.md").exists()})
    assert not missing, "documents cited that the project does not contain:\n" + "\n".join(missing)


def cited_sections(text: str) -> list[tuple[str, str]]:
    """(file, section name) for each `file.md, "Section"` in a text, its line breaks and comment marks
    between the words taken out."""
    return SECTION.findall(re.sub(r"\s*\n\s*(?:#\s*)?", " ", text))


def has_section(path: Path, name: str) -> bool:
    """Whether a heading of `path` starts with `name` (a trailing "..." shortens a long one)."""
    wanted = name.rstrip(".").strip()
    return path.exists() and any(h.startswith(wanted) for h in headings(path))


def flat(path: Path) -> str:
    """A file's text on one line: line breaks and comment marks between words taken out."""
    return re.sub(r"\s*\n\s*(?:#\s*)?", " ", path.read_text(encoding="utf-8"))


def test_cited_notes_exist():
    """Every `[Why ...]` the docs, tests or code cite is a `Note: [Why ...]` of the code (the notebook,
    a record, may name notes of code since removed)."""
    sources = [p for folder in ("hf_slideformer", "triton_ops", "benchmarks") for pattern in ("*.py", "*.c")
               for p in (ROOT / folder).rglob(pattern)]
    notes = {name for p in sources for name in re.findall(r"Note: \[(Why[^\]]+)\]", flat(p))}
    assert len(notes) > 20
    missing = sorted({f"{doc.relative_to(ROOT)}: [{name}]" for doc in CITING + sources if doc.name != "NOTEBOOK.md"
                      for name in re.findall(r"\[(Why[^\]]+)\]", flat(doc))
                      if name not in notes and not name.endswith("...")})
    assert not missing, "notes cited that no code defines:\n" + "\n".join(missing)


def results_rows(text: str) -> list[list[str]]:
    """The cells of every table row in `text` (header and rule rows left out)."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and not line.startswith("|---")]
    return [r for r in rows if r[0] != "run"]


def test_the_readme_results_are_the_benchmarks_current_figures():
    """Each README result row gives a tokens/s figure that docs/benchmarks.md's current results hold,
    and a step time that matches it (tokens per step / tokens/s, within the rounding)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = readme[readme.index("\n## Results"):readme.index("\n## ", readme.index("\n## Results") + 1)]
    bench = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    current = bench[bench.index("\n## Current results"):]
    rows = results_rows(results)
    assert len(rows) >= 10
    for run, tokens_s, step, *_ in rows:
        figure = tokens_s.strip("*")
        in_current = re.search(rf"(?<![\d,]){re.escape(figure)}(?![\d,])", current)
        assert in_current, f"{run}: {figure} not in docs/benchmarks.md"
        batch = re.search(r"batch (\d+)(?: x (\d+) accumulated)?(?: x ([\d,]+) tokens)?", run)
        assert batch, run
        tokens = int(batch[1]) * int(batch[2] or 1) * int((batch[3] or "2048").replace(",", ""))
        assert abs(tokens / float(figure.replace(",", "")) / float(step) - 1) < 0.02, run


HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md", "docs/engine.md", "docs/placements.md"])
def test_reference_docs_name_no_commits(name):
    """History (which commit measured what) lives in benchmarks/NOTEBOOK.md and git, not in these."""
    assert not HASH.findall(prose(ROOT / name)), HASH.findall(prose(ROOT / name))


def test_the_readme_stays_a_front_page():
    """About 150 lines, result tables of at most 8 rows per shape, cells without history."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 170
    tables = re.findall(r"(?:^\|.*\n)+", readme, flags=re.M)
    assert tables and all(len(results_rows(table)) <= 8 for table in tables)
    assert max(len(cell) for table in tables for row in results_rows(table) for cell in row) <= 110
    assert HASH.findall("measured at 7a71d76, not at 2026 or deadline") == ["7a71d76"]
