"""Docstrings and docs cite what a reader can open: repository paths that exist, never the out-of-repo
design.md."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CODE = ("engine", "gateway", "kvscope", "kernels", "bench", "dashboards", "scripts")
TOP = (
    "engine",
    "gateway",
    "kvscope",
    "kernels",
    "bench",
    "dashboards",
    "docs",
    "alerts",
    "deploy",
    "scripts",
    "tests",
)
PATH = re.compile(r"(?<![\w/.-])((?:" + "|".join(TOP) + r")/[\w/.-]*\w\.(?:py|md|yaml|yml|json|sh|toml))")


def _texts(roots: tuple[str, ...], suffixes: tuple[str, ...]) -> dict[str, str]:
    files = [f for root in roots for f in (REPO / root).rglob("*") if f.suffix in suffixes and f.is_file()]
    return {
        str(f.relative_to(REPO)): f.read_text(encoding="utf-8", errors="replace")
        for f in files
        if "__pycache__" not in f.parts
    }


def test_every_cited_repository_path_exists() -> None:
    texts = _texts((*CODE, "docs"), (".py", ".md", ".yaml"))
    texts["README.md"] = (REPO / "README.md").read_text(encoding="utf-8")
    missing = sorted(
        {
            (m.group(1), name)
            for name, text in texts.items()
            for m in PATH.finditer(text)
            if not (REPO / m.group(1)).exists()
        }
    )
    assert missing == []


def test_no_code_cites_the_design_doc_that_is_not_in_the_repo() -> None:
    citing = sorted(name for name, text in _texts(CODE, (".py",)).items() if "design.md" in text)
    assert citing == []


def test_a_name_cited_beside_a_file_is_defined_in_it() -> None:
    """``engine/worker/kv_cache.py ``budget_num_blocks```: the name is in that file (kvscope plan once cited
    ``engine/engine_core.py _budget_blocks`` after the function had moved)."""
    cited = re.compile(r"((?:" + "|".join(TOP) + r")/[\w/]+\.py)[`\s,(]+``?([A-Za-z_]\w*)")
    texts = _texts((*CODE, "docs"), (".py", ".md"))
    stale = sorted(
        {
            (m.group(1), m.group(2), name)
            for name, text in texts.items()
            for m in cited.finditer(text)
            if (REPO / m.group(1)).is_file() and m.group(2) not in (REPO / m.group(1)).read_text()
        }
    )
    assert stale == []


def test_every_cited_benchmarks_heading_exists() -> None:
    """``docs/benchmarks.md "Heading"``: a heading of docs/benchmarks.md starts with the quoted text (a
    citation may shorten it). The measurements live there, and docstrings point at them by heading."""
    headings = [
        line.lstrip("#").strip()
        for line in (REPO / "docs" / "benchmarks.md").read_text(encoding="utf-8").splitlines()
        if line.startswith("#")
    ]
    texts = _texts((*CODE, "docs"), (".py", ".md", ".sh", ".cpp", ".yaml"))
    texts["README.md"] = (REPO / "README.md").read_text(encoding="utf-8")
    cite = re.compile(r'docs/benchmarks\.md "([^"]+)"')
    missing = sorted(
        {
            (m.group(1), name)
            for name, text in texts.items()
            if name != "docs/benchmarks.md"
            for m in cite.finditer(re.sub(r"\s*\n\s*(?:#+|//)?\s*", " ", text))
            if not any(h.startswith(m.group(1)) for h in headings)
        }
    )
    assert missing == []
