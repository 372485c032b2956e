"""Files generated from sources and committed (Grafana dashboards and docs/metrics.md, the Kubernetes tree):
find the stale ones, and rewrite them or, with ``--check``, report them. One mechanism for every generator
(kvscope/dashboards/generate.py, kvscope/deploy/generate.py), so ``make lint`` checks them all alike."""

from __future__ import annotations

import sys
from pathlib import Path


def stale_files(files: dict[Path, str], root: Path | None = None) -> list[Path]:
    """Paths whose content on disk differs from ``files`` (missing ones included), then, with ``root``, the
    files under ``root`` that are not generated (a leftover of a renamed file would otherwise ship)."""
    differ = [p for p, text in files.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    if root is None or not root.exists():
        return differ
    return differ + [p for p in sorted(root.rglob("*")) if p.is_file() and p not in files]


def write_or_check(files: dict[Path, str], stale: list[Path], check: bool, command: str, repo: Path) -> int:
    """With ``check``: print each stale path (and ``command``, which regenerates it) to stderr and return 1
    if there is any, else 0. Without: write the stale generated files, remove the stale extra ones, print
    what changed and return 0. Paths print relative to ``repo``."""
    if check:
        for path in stale:
            print(f"stale: {_shown(path, repo)} (run: {command})", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        if path in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(files[path], encoding="utf-8")
            print(f"wrote {_shown(path, repo)}")
        else:
            path.unlink()
            print(f"removed {_shown(path, repo)}")
    return 0


def _shown(path: Path, repo: Path) -> str:
    return str(path.relative_to(repo)) if path.is_relative_to(repo) else str(path)
