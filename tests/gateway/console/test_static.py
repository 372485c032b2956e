"""The console's static files: the vendored uPlot is the pinned release (hashes in its README), every file
goes into a built wheel (pyproject.toml's package-data), and the page loads nothing from elsewhere and
nothing inline (its Content-Security-Policy allows neither)."""

from __future__ import annotations

import fnmatch
import hashlib
import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CONSOLE = REPO / "gateway" / "console"
VENDOR = CONSOLE / "static" / "vendor"
VENDORED = {
    "uPlot.iife.min.js": "19c8d4c6ad88929a79f4ae49d6f7161566dfd0ba3d15cc495e974f787eb78f1f",
    "uPlot.min.css": "df630c6a8d6f8eeaff264b50f73ce5b114f646ffd9a0bb74f049b0a00135fa04",
    "LICENSE": "8f989229699b4fe2f1a0432d0e9edc338a8a911e250e2d1b01ecd770a5f5b1bd",
}
"""uPlot 1.6.32 from ``npm pack uplot@1.6.32`` (static/vendor/README.md)."""


def test_the_vendored_chart_library_is_the_pinned_release() -> None:
    assert {p.name for p in VENDOR.iterdir()} == {*VENDORED, "README.md"}
    readme = (VENDOR / "README.md").read_text()
    for name, digest in VENDORED.items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest
        assert f"{digest}  {name}" in readme
    assert (
        (VENDOR / "uPlot.iife.min.js")
        .read_text()
        .startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")
    )
    assert (VENDOR / "LICENSE").read_text().startswith("The MIT License (MIT)")


def test_every_static_file_is_package_data() -> None:
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "kvscope.gateway.console"
    ]
    files = [
        p.relative_to(CONSOLE).as_posix() for p in CONSOLE.rglob("*") if p.is_file() and p.suffix != ".py"
    ]
    files = [f for f in files if "__pycache__" not in f]
    assert "kvscope.rules.yaml" in files and "static/vendor/uPlot.iife.min.js" in files
    assert [f for f in files if not any(fnmatch.fnmatch(f, p) for p in patterns)] == []


def test_the_page_loads_only_its_own_files() -> None:
    html = (CONSOLE / "static" / "index.html").read_text()
    assert sorted(re.findall(r'(?:src|href)="([^"]+)"', html)) == [
        "/console",  # the name and the overview
        "/console",
        "/console/health",
        "/console/requests",
        "/console/static/console.css",
        "/console/static/console.js",
        "/console/static/favicon.svg",
        "/console/static/vendor/uPlot.iife.min.js",
        "/console/static/vendor/uPlot.min.css",
    ]
    assert (
        "<style" not in html and "style=" not in html and re.search(r"<script(?![^>]*\bsrc=)", html) is None
    )
    script = (CONSOLE / "static" / "console.js").read_text()
    assert "innerHTML" not in script and "http://" not in script and "https://" not in script


def test_the_page_asks_at_most_once_a_second() -> None:
    """Polling, at most once a second: the overview every POLL_MS, the request list and health every LIST_MS
    (ms), through every() alone."""
    script = (CONSOLE / "static" / "console.js").read_text()
    periods = dict(re.findall(r"const (POLL_MS|LIST_MS) = (\d+);", script))
    assert periods == {"POLL_MS": "1000", "LIST_MS": "2000"}
    assert re.findall(r"\bevery\(([A-Z_]+),", script) == ["POLL_MS", "LIST_MS", "LIST_MS"]
    assert script.count("setInterval(") == 1 and "setTimeout(" not in script  # the one timer: every()
