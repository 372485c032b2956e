"""pytest-xdist scheduling for ``make test`` (``--dist loadfile``): the test files that take one of the
expensive session fixtures in ``SHARED_FIXTURES`` run on one worker as one unit, so the fixture is built once
per run instead of once on each worker that happens to get one of them.

``hf_model`` (tests/conftest.py: transformers' own load of the SmolLM2 GGUF, about 15 s on a 2-vCPU host) is
taken by three files (test_loader.py, test_eval_model.py, test_llm_parity.py); with two workers ``loadfile``
used to spread them, and both workers loaded it. Any other test file keeps its own unit, as ``loadfile``
makes it. Registered from tests/conftest.py; without xdist (or with another ``--dist``) nothing changes.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

SHARED_FIXTURES = ("hf_model",)
"""Session fixtures worth one build per run: every file that takes one joins that fixture's unit."""


def files_taking(fixtures: tuple[str, ...], dirs: list[Path], root: Path) -> dict[str, str]:
    """``{test file under dirs, relative to root (as pytest's node ids write it): the first of fixtures it
    takes}``: a file takes a fixture when one of its functions has a parameter of that name."""
    out = {}
    for path in sorted(p for d in dirs for p in d.rglob("test_*.py")):
        taken = {
            arg.arg
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for arg in node.args.args
        }
        for fixture in fixtures:
            if fixture in taken:
                out[path.relative_to(root).as_posix()] = fixture
                break
    return out


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadfile`` with the files sharing a fixture in one unit; None (xdist's own choice) for any
    other distribution mode."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    dirs = [config.rootpath / p for p in config.getini("testpaths")] or [config.rootpath]
    groups = files_taking(SHARED_FIXTURES, dirs, config.rootpath)

    class SharedFixtureScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return f"shared fixture {groups[file]}" if file in groups else file

    return SharedFixtureScheduling(config, log)
