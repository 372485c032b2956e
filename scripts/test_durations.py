"""The durations report `make test` keeps in test-artifacts/durations.txt, read from pytest's JUnit XML.

    python scripts/test_durations.py test-artifacts/junit.xml [--workers 2] [--top 25]

Prints the run's wall time (the ``<testsuite time>`` pytest writes: session start to end, as the
controlling process of pytest-xdist saw it), the machine (CPUs, model), the outcome counts, the sum of every
test's seconds, then the slowest test files and the slowest tests. A test's seconds are pytest's
``junit_duration_report = total`` (the default): setup + call + teardown, so a module fixture's start is
charged to the first test that used it, and a file's seconds are the sum of its tests'. ``-o
junit_family=xunit1`` (the Makefile passes it) puts each test's file in the XML; without it the file is
derived from the dotted class name.
"""

from __future__ import annotations

import argparse
import os
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True, slots=True)
class Case:
    """One ``<testcase>``: its file, node id, seconds and outcome (passed, failed, error, skipped)."""

    file: str
    nodeid: str
    seconds: float
    outcome: str


@dataclass(frozen=True, slots=True)
class Run:
    """A JUnit file's run: wall seconds, timestamp (ISO 8601, as pytest wrote it) and the test cases."""

    wall_s: float
    timestamp: str
    cases: list[Case]


def read_junit(path: Path) -> Run:
    """Parse pytest's JUnit XML (``<testsuites><testsuite>`` or a bare ``<testsuite>``). Raises
    FileNotFoundError, ET.ParseError, or ValueError when there is no testsuite."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise ValueError(f"{path}: no <testsuite>")
    cases = []
    for case in suite.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        file = case.get("file") or _file_of(classname)
        outcome = next(
            (tag for tag in ("failure", "error", "skipped") if case.find(tag) is not None),
            "passed",
        )
        cases.append(Case(file, f"{file}::{name}", float(case.get("time", 0)), _OUTCOME[outcome]))
    return Run(float(suite.get("time", 0)), suite.get("timestamp", ""), cases)


_OUTCOME = {"failure": "failed", "error": "error", "skipped": "skipped", "passed": "passed"}


def _file_of(classname: str) -> str:
    """``tests.engine.test_loader.TestX`` → ``tests/engine/test_loader.py`` (the parts up to the first that
    starts with ``test_``)."""
    parts = classname.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return "/".join(parts[: i + 1]) + ".py"
    return "/".join(parts) + ".py"


def cpu_model(cpuinfo: Path = CPUINFO) -> str:
    """The first ``model name`` of /proc/cpuinfo; ``unknown CPU`` where there is none."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def report(run: Run, workers: int | None, cpus: int | None, cpu: str, top: int) -> str:
    """The report's text (seconds with one decimal; counts with thousands separators)."""
    counts = {o: sum(c.outcome == o for c in run.cases) for o in ("passed", "failed", "error", "skipped")}
    per_file: dict[str, list[Case]] = defaultdict(list)
    for case in run.cases:
        per_file[case.file].append(case)
    files = sorted(per_file.items(), key=lambda kv: (-sum(c.seconds for c in kv[1]), kv[0]))
    tests = sorted(run.cases, key=lambda c: (-c.seconds, c.nodeid))
    workers_text = f"{workers} pytest workers" if workers else "pytest workers unknown"
    machine = f"{cpus or '?'} CPUs, {cpu}"
    outcomes = ", ".join(f"{n:,} {o}" for o, n in counts.items())
    total = sum(c.seconds for c in run.cases)
    lines = [
        f"wall time: {run.wall_s:,.1f} s ({workers_text}; {machine}; {run.timestamp or 'no date'})",
        f"tests: {len(run.cases):,} ({outcomes})",
        f"sum of the tests' seconds (setup + call + teardown, all workers): {total:,.1f} s",
        "",
        f"slowest {min(top, len(files))} files (seconds, tests):",
        *(f"{sum(c.seconds for c in cs):9.1f} {len(cs):5d}  {f}" for f, cs in files[:top]),
        "",
        f"slowest {min(top, len(tests))} tests (seconds):",
        *(f"{c.seconds:9.1f}  {c.nodeid}" for c in tests[:top]),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="durations report from pytest's JUnit XML")
    parser.add_argument("junit", type=Path)
    parser.add_argument("--workers", type=int, default=None, help="pytest-xdist workers of the run")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    try:
        run = read_junit(args.junit)
    except (OSError, ET.ParseError, ValueError) as exc:
        print(f"test_durations: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write(report(run, args.workers, os.cpu_count(), cpu_model(), args.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
