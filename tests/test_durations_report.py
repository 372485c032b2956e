"""scripts/test_durations.py: the durations report `make test` keeps in test-artifacts/durations.txt, from
pytest's JUnit XML (wall time, outcome counts, slowest files and tests, exact figures)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite name="pytest"
errors="1" failures="1" skipped="1" tests="5" time="612.345" timestamp="2026-12-06T22:00:00+00:00">
<testcase classname="tests.e2e.test_serve" name="test_a" file="tests/e2e/test_serve.py" time="40.25" />
<testcase classname="tests.e2e.test_serve" name="test_b" file="tests/e2e/test_serve.py" time="2.5">
<failure message="boom" /></testcase>
<testcase classname="tests.engine.test_loader.TestX" name="test_c" time="30.0" />
<testcase classname="tests.test_alerts" name="test_d" file="tests/test_alerts.py" time="0.125">
<skipped message="no tool" /></testcase>
<testcase classname="tests.test_alerts" name="test_e" file="tests/test_alerts.py" time="1.0">
<error message="fixture" /></testcase>
</testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def durations() -> Iterator[ModuleType]:
    """scripts/test_durations.py as a module (registered: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(
        "test_durations_script", ROOT / "scripts" / "test_durations.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_the_report_states_wall_time_machine_outcomes_and_the_slowest(
    tmp_path: Path, durations: ModuleType
) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    run = durations.read_junit(junit)
    assert durations.report(run, 2, 2, "AMD EPYC 7B13", top=2) == (
        "wall time: 612.3 s (2 pytest workers; 2 CPUs, AMD EPYC 7B13; 2026-12-06T22:00:00+00:00)\n"
        "tests: 5 (2 passed, 1 failed, 1 error, 1 skipped)\n"
        "sum of the tests' seconds (setup + call + teardown, all workers): 73.9 s\n"
        "\n"
        "slowest 2 files (seconds, tests):\n"
        "     42.8     2  tests/e2e/test_serve.py\n"
        "     30.0     1  tests/engine/test_loader.py\n"
        "\n"
        "slowest 2 tests (seconds):\n"
        "     40.2  tests/e2e/test_serve.py::test_a\n"
        "     30.0  tests/engine/test_loader.py::test_c\n"
    )


def test_a_missing_or_broken_file_is_an_error_not_a_report(
    tmp_path: Path, durations: ModuleType, capsys
) -> None:
    assert durations.main([str(tmp_path / "none.xml")]) == 1
    (tmp_path / "bad.xml").write_text("<testsuites><testsuite")
    assert durations.main([str(tmp_path / "bad.xml")]) == 1
    (tmp_path / "empty.xml").write_text("<testsuites></testsuites>")
    assert durations.main([str(tmp_path / "empty.xml")]) == 1
    assert capsys.readouterr().err.count("test_durations: ") == 3


def test_the_cpu_model_comes_from_cpuinfo(tmp_path: Path, durations: ModuleType) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu\n")
    assert durations.cpu_model(cpuinfo) == "AMD EPYC 7B13"
    assert durations.cpu_model(tmp_path / "missing") == "unknown CPU"
