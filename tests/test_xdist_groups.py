"""tests/xdist_groups.py: under ``--dist loadfile`` the files that take a shared session fixture run on one
worker (one build of the fixture per run), and every other file is still a unit of its own."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.xdist_groups import SHARED_FIXTURES, files_taking, pytest_xdist_make_scheduler

REPO = Path(__file__).resolve().parents[1]
CONFTEST = (
    f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
    "import os\nimport pytest\n"
    "pytest_plugins = ['tests.xdist_groups']\n\n"
    "@pytest.fixture(scope='session')\n"
    "def hf_model():\n"
    "    return os.environ.get('PYTEST_XDIST_WORKER', 'main')\n\n"
    "@pytest.fixture\n"
    "def worker():\n"
    "    return os.environ.get('PYTEST_XDIST_WORKER', 'main')\n"
)
TAKES = "def test_{name}(hf_model, record_property):\n    record_property('worker', hf_model)\n"
ALONE = "def test_{name}(worker, record_property):\n    record_property('worker', worker)\n"


def test_the_suites_hf_model_files_are_found() -> None:
    assert SHARED_FIXTURES == ("hf_model",)
    assert files_taking(SHARED_FIXTURES, [REPO / "tests"], REPO) == {
        "tests/engine/test_eval_model.py": "hf_model",
        "tests/engine/test_llm_parity.py": "hf_model",
        "tests/engine/test_loader.py": "hf_model",
    }


def make_suite(pytester: pytest.Pytester) -> None:
    """Three files taking ``hf_model``, three that do not, under ``testpaths = suite``."""
    pytester.makeconftest(CONFTEST)
    pytester.makeini("[pytest]\ntestpaths = suite\n")
    suite = pytester.mkpydir("suite")
    for i in range(3):
        (suite / f"test_takes_{i}.py").write_text(TAKES.format(name=f"takes_{i}"))
        (suite / f"test_alone_{i}.py").write_text(ALONE.format(name=f"alone_{i}"))


def test_the_files_taking_the_fixture_are_one_unit_and_the_others_their_own(
    pytester: pytest.Pytester,
) -> None:
    make_suite(pytester)
    scheduler = pytest_xdist_make_scheduler(
        pytester.parseconfig("--tx", "2*popen", "--dist", "loadfile"), None
    )
    units = {
        name: scheduler._split_scope(f"suite/{name}.py::test_x")
        for name in [f"test_{kind}_{i}" for kind in ("takes", "alone") for i in range(3)]
    }
    assert units == {
        "test_takes_0": "shared fixture hf_model",
        "test_takes_1": "shared fixture hf_model",
        "test_takes_2": "shared fixture hf_model",
        "test_alone_0": "suite/test_alone_0.py",
        "test_alone_1": "suite/test_alone_1.py",
        "test_alone_2": "suite/test_alone_2.py",
    }
    assert (
        pytest_xdist_make_scheduler(pytester.parseconfig("--tx", "2*popen", "--dist", "load"), None) is None
    )


def test_xdist_runs_them_on_one_worker(pytester: pytest.Pytester) -> None:
    """The hook as xdist calls it: the three files' tests all run where the fixture was built once."""
    make_suite(pytester)
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadfile", "--junitxml=junit.xml")
    result.assert_outcomes(passed=6)
    workers = {
        case.get("name"): case.find("properties/property[@name='worker']").get("value")  # type: ignore[union-attr]
        for case in ET.parse(pytester.path / "junit.xml").iter("testcase")
    }
    assert len({workers[f"test_takes_{i}"] for i in range(3)}) == 1
    assert set(workers.values()) <= {"gw0", "gw1"}
