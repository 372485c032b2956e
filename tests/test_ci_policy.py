"""The CI policy of tests/conftest.py, proved on inner pytest sessions: under CI=true a skip fails the run
unless its reason is allow-listed (no CUDA device, no ELASTICSEARCH_URL); off CI, skips stay skips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
# The inner session (and each xdist worker) imports the repository's tests.conftest; the root is off sys.path
# by design (tests/conftest.py), so the inner conftest puts it there itself.
CONFTEST = (
    f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
    "from tests.conftest import pytest_collection_modifyitems, pytest_sessionfinish, "
    "pytest_terminal_summary\n"
)
INI = "[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    gpu: needs a CUDA device\n"
ALLOWED = """
import os
import pytest

@pytest.mark.gpu
def test_on_a_gpu():
    raise AssertionError("runs only with CUDA")

@pytest.mark.skipif(not os.environ.get("ELASTICSEARCH_URL"), reason="set ELASTICSEARCH_URL to run against ES")
def test_live_es():
    pass

def test_passes():
    assert 1 + 1 == 2
"""
DELIBERATE = """
import pytest

def test_not_written_yet():
    pytest.skip("x")

def test_passes():
    assert True
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same answer on a GPU machine
    monkeypatch.delenv("ELASTICSEARCH_URL", raising=False)
    pytester.makeconftest(CONFTEST)
    pytester.makeini(INI)
    return pytester


@pytest.mark.parametrize("workers", [(), ("-n", "2", "--dist", "loadfile")], ids=["one-process", "xdist"])
def test_a_deliberate_skip_fails_the_run_under_ci(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, workers: tuple[str, ...]
) -> None:
    """Also with the workers ``make test`` runs (the skips are counted in the controlling process)."""
    monkeypatch.setenv("CI", "true")
    inner.makepyfile(DELIBERATE)
    result = inner.runpytest(*workers)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        [
            "*skips not allowed under CI=true*",
            "SKIPPED test_a_deliberate_skip_fails_the_run_under_ci.py::test_not_written_yet: x",
        ]
    )


def test_allowed_reasons_keep_the_run_green_under_ci(
    inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CI", "true")
    inner.makepyfile(ALLOWED)
    result = inner.runpytest("-rs")
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=2)
    result.stdout.fnmatch_lines(["*needs a CUDA device*", "*set ELASTICSEARCH_URL*"])
    assert "skips not allowed" not in result.stdout.str()


def test_off_ci_a_skip_is_only_reported(inner: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    inner.makepyfile(DELIBERATE)
    result = inner.runpytest()
    assert result.ret == pytest.ExitCode.OK
    result.assert_outcomes(passed=1, skipped=1)


def test_the_suite_runs_under_a_global_timeout(pytestconfig: pytest.Config) -> None:
    assert float(pytestconfig.getini("timeout")) == 300.0
